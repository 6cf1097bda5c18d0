//! Spawning through the service: the gate and the engine's spawn on the
//! blocking pool, then the adoption of the new tree (its watch task).

use super::*;

impl Service {
    /// Spawns a tree for a client (or for the service itself when no
    /// `owner_pid` is given) and starts watching it.
    /// Spawns a tree and takes it into custody. The work runs in its own
    /// task: a client that disconnects (or a request that times out) drops
    /// only the wait for the answer, never the step between "the tree
    /// runs" and "the tree is watched".
    pub async fn spawn(self: &Arc<Self>, p: SpawnParams) -> Result<TreeRow, ServiceError> {
        self.spawn_reserved(p, None).await
    }

    /// A place among `owner`'s spawns in flight, taken before its live
    /// trees are counted for `serve --max-trees-per-user` (see `admit.rs`);
    /// hand it to [`Self::spawn_reserved`].
    pub fn reserve_spawn(&self, owner: crate::ledger::TreeOwner) -> Reservation {
        self.in_flight.enter(owner)
    }

    /// [`Self::spawn`], holding `reservation` until the spawn's own task
    /// has committed the tree or failed: a client that hangs up drops the
    /// wait, not the reservation.
    pub async fn spawn_reserved(
        self: &Arc<Self>,
        p: SpawnParams,
        reservation: Option<Reservation>,
    ) -> Result<TreeRow, ServiceError> {
        let this = self.clone();
        tokio::spawn(async move {
            let spawned = this.spawn_and_adopt(p).await;
            drop(reservation);
            spawned
        })
        .await
        .map_err(|e| ServiceError::Task(e.to_string()))?
    }

    // Over 100 lines on purpose: the drain gate read on the first line is held through every check,
    // the owner's exit watch, the spawn and the adoption (dropped only after `adopt`), so a drain
    // never misses a tree; one frame shows the gate's whole span.
    pub(super) async fn spawn_and_adopt(
        self: &Arc<Self>,
        p: SpawnParams,
    ) -> Result<TreeRow, ServiceError> {
        let gate = self.draining.read().await;
        if *gate {
            return Err(ServiceError::ShuttingDown);
        }
        // The ledger keeps its reserve: a tree that logs into the data dir
        // is refused while its free space is under the floor, so a tree
        // filling the disk through its own output cannot make the next
        // authorization fail.
        if let Some(free) = free_bytes(self.engine.data_dir())
            && free < self.config.min_free
        {
            return Err(ServiceError::Busy(format!(
                "{} has {} MiB free, under the floor of {} MiB the ledger keeps (serve --min-free): no new logged tree",
                self.engine.data_dir().display(),
                free >> 20,
                self.config.min_free >> 20
            )));
        }
        if !self.config.allow_commands.is_empty()
            && !self.config.allow_commands.iter().any(|c| *c == p.argv[0])
        {
            return Err(ServiceError::Invalid(format!(
                "command {:?} is not allowed here (serve --allow-command)",
                p.argv[0]
            )));
        }
        // With an allowlist of commands the environment is an allowlist
        // too: a denylist of PATH and LD_* would let BASH_ENV, SHELLOPTS + PS4 run
        // code before an allowed script.
        if !self.config.allow_commands.is_empty()
            && let Some((k, _)) = p
                .env
                .iter()
                .find(|(k, _)| !self.config.allow_env.iter().any(|a| a == k))
        {
            return Err(ServiceError::Invalid(format!(
                "env {k} may not be set while serve --allow-command restricts commands (name it with --allow-env)"
            )));
        }
        // The owner's identity is read now, and its exit watch opened before
        // the tree exists: there is no moment when the tree runs unwatched.
        let (owner, kind, owner_fd) = match p.owner_pid {
            None => (self.me.clone(), OwnerKind::Service, None),
            Some(pid) => {
                let gone =
                    || ServiceError::Invalid(format!("owner_pid {pid} is not a live process"));
                // Whatever the kernel says about a pid a client chose (a
                // thread id, a kernel thread, a race with its exit) is a bad
                // request, not a server fault.
                let id = crate::proc::identity_of(pid)
                    .ok()
                    .flatten()
                    .ok_or_else(gone)?;
                let kernel_thread = pid == 2
                    || crate::proc::read_stat(pid)
                        .ok()
                        .flatten()
                        .is_some_and(|s| s.ppid == 2);
                if kernel_thread {
                    return Err(ServiceError::Invalid(format!(
                        "owner_pid {pid} is a kernel thread: it never exits"
                    )));
                }
                if let Some(start) = p.owner_start_ticks
                    && start != id.start_ticks
                {
                    return Err(ServiceError::Invalid(format!(
                        "owner_pid {pid} started at tick {}, not {start}: a different process",
                        id.start_ticks
                    )));
                }
                if pid == self.me.pid {
                    return Err(ServiceError::Invalid(
                        "owner_pid is the service itself: omit owner_pid".into(),
                    ));
                }
                // A thread id that is not a process leader cannot be
                // watched (pidfd_open refuses it): not a live process.
                let fd = crate::proc::open_exit_watch(&id)
                    .ok()
                    .flatten()
                    .ok_or_else(gone)?;
                (id, OwnerKind::Client, Some(fd))
            }
        };
        // A tree that runs as another user does not inherit the service's
        // environment (it may hold the service's secrets: OTLP headers,
        // tokens): only PATH and the locale and time zone, then that user's
        // HOME, USER, LOGNAME and SHELL; and `/` as its working directory
        // when the request names none (the service's own may be closed to
        // it). The request's own variables come last and win.
        let mut cwd = p.cwd.clone();
        let mut env: Vec<(OsString, OsString)> = match &p.run_as {
            None => std::env::vars_os().collect(),
            Some(run_as) => {
                let who = run_as.user.as_ref();
                let name: OsString = who.map_or_else(
                    || run_as.credentials.uid.to_string().into(),
                    |u| u.name.clone().into(),
                );
                let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
                    .filter(|(k, _)| {
                        k == "PATH"
                            || k == "LANG"
                            || k == "TZ"
                            || k.to_string_lossy().starts_with("LC_")
                    })
                    .collect();
                if !env.iter().any(|(k, _)| k == "PATH") {
                    env.push(("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()));
                }
                env.extend([
                    (
                        "HOME".into(),
                        who.map_or_else(|| "/".into(), |u| u.home.clone().into_os_string()),
                    ),
                    ("USER".into(), name.clone()),
                    ("LOGNAME".into(), name),
                    (
                        "SHELL".into(),
                        who.map_or_else(|| "/bin/sh".into(), |u| u.shell.clone().into_os_string()),
                    ),
                ]);
                cwd.get_or_insert_with(|| PathBuf::from("/"));
                env
            }
        };
        if !self.config.allow_commands.is_empty() {
            env = allowlisted_env(env);
        }
        env.retain(|(k, _)| !p.env.iter().any(|(n, _)| OsString::from(n) == *k));
        env.extend(p.env.iter().map(|(k, v)| (k.into(), v.into())));
        let on_behalf = match (&p.requester, &p.run_as) {
            (None, None) => None,
            (requester, run_as) => Some(crate::custody::OnBehalf {
                requester: requester.clone().unwrap_or_default(),
                run_as: run_as.as_ref().map(|r| r.credentials.clone()),
            }),
        };
        let req = SpawnRequest {
            on_behalf,
            argv: p.argv.iter().map(OsString::from).collect(),
            label: p.label.clone(),
            cwd,
            env: Some(env),
            stdio: if p.stdio.0.iter().any(Option::is_some) {
                SpawnStdio::Given(p.stdio.clone())
            } else {
                SpawnStdio::Log
            },
            owner: owner.clone(),
            owner_kind: kind,
            grace: Some(p.grace.unwrap_or(self.config.default_grace)),
            timeout: p.timeout,
            limits: p.limits,
            // The unit runs the service with UMask=0077 (its own files are
            // private); the work it spawns gets the usual 022.
            umask: Some(0o022),
            first_signal: p.first_signal,
        };
        let engine = self.engine.clone();
        let lifetime = p.lifetime;
        let spawned = blocking(move || {
            let spawned = engine.spawn(&req)?;
            if lifetime == crate::custody::Lifetime::Owner {
                crate::custody::mark_lifetime_owner(engine.ledger(), spawned.tree);
            }
            Ok::<_, CustodyError>(spawned)
        })
        .await??;
        let tree = spawned.tree;
        if let Some(h) = &self.observer_handle {
            h.watch(tree, spawned.pgid, spawned.sid, &spawned.root);
        }
        let client_owner = (kind == OwnerKind::Client).then(|| owner.clone());
        self.adopt(
            tree,
            client_owner,
            Some(spawned.root.clone()),
            owner_fd,
            p.timeout,
            p.lifetime,
        );
        drop(gate);
        let engine = self.engine.clone();
        let row = blocking(move || engine.ledger().tree(tree)).await??;
        row.ok_or(ServiceError::Custody(CustodyError::UnknownTree(tree)))
    }

    /// Registers a tree as owned and starts its watch task.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn adopt(
        self: &Arc<Self>,
        tree: TreeId,
        client_owner: Option<Identity>,
        root: Option<Identity>,
        owner_fd: Option<crate::proc::ExitHandle>,
        timeout: Option<Duration>,
        lifetime: crate::custody::Lifetime,
    ) {
        let done = self.shutdown.child_token();
        {
            let mut owned = self.lock_owned();
            self.owned_version
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            owned.insert(
                tree,
                Owned {
                    client_owner,
                    lock: Arc::new(Mutex::new(())),
                    done: done.clone(),
                },
            );
        }
        let root_watch = root.as_ref().map(|r| RootWatch::open(self.reaper, r));
        let root_gone = matches!(root_watch, Some(RootWatch::Gone));
        let this = self.clone();
        let settled = done.clone();
        self.tasks.spawn(async move {
            let owner = owner_fd.and_then(|fd| crate::proc::ExitWatch::new(fd).ok());
            let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
            let mut watch = OwnerWatch::new(lifetime, deadline.map(tokio::time::Instant::into_std), timeout);
            if !watch_tree(&done, root_watch, root_gone, owner.as_ref(), deadline, &mut watch).await {
                return;
            }
            // `"lifetime": "owner"`: the root's exit is recorded and the
            // tree kept while anything of it runs, until its owner exits,
            // its timeout fires, or it is killed (`done`).
            let mut kept_root_exit = None;
            if let (true, Some(r)) = (watch.is_kept(), &root) {
                let (engine, reaper, r) = (this.engine.clone(), this.reaper, r.clone());
                let kept = blocking(move || {
                    let status = reaper.and_then(|rp| rp.wait_exit(r.pid, Some(Duration::from_secs(1))));
                    let empty = engine.tree_empty_now(tree);
                    if !empty {
                        engine.record_root_exit_kept(tree, &r, status);
                    }
                    (status, empty)
                })
                .await;
                // A check that did not run ends the tree, as an empty one.
                watch.handle_tick(Some(!matches!(kept, Ok((_, false)))));
                if let Ok((status, false)) = kept {
                    kept_root_exit = status;
                    if !this.watch_kept(&done, tree, owner.as_ref(), deadline, &mut watch).await {
                        return;
                    }
                }
            }
            // Kept with no root to check cannot be: a root's exit keeps a tree.
            let Action::TearDown(mut why) = watch.poll() else {
                return;
            };
            let root_exit = match (&why, &root) {
                _ if kept_root_exit.is_some() => kept_root_exit,
                (EndCause::RootExited(_), Some(r)) if this.reaper.is_some() => {
                    let reaper = this.reaper;
                    let pid = r.pid;
                    blocking(move || {
                        reaper.and_then(|r| r.wait_exit(pid, Some(Duration::from_secs(1))))
                    })
                        .await
                        .ok()
                        .flatten()
                }
                _ => None,
            };
            // The root's status, now that it is known (or still not).
            if let EndCause::RootExited(status) = &mut why {
                *status = root_exit;
            }
            let why = why;
            let reason = why.reason();
            // The sweep leaves owned trees alone, so this task is the one
            // that must see the teardown through: a ledger that refused a
            // write, a lease held elsewhere, survivors — try again, backing
            // off, until the tree is settled (or resolved, or the drain takes
            // over at shutdown).
            let mut backoff = Duration::from_secs(1);
            loop {
                match this
                    .teardown(tree, None, None, why.clone(), reason.clone())
                    .await
                {
                    Ok(r) if r.state.is_terminal() => return,
                    Ok(r) => tracing::warn!(tree = tree.0, state = %r.state, "teardown left the tree unsettled; retrying"),
                    Err(e) => tracing::error!(tree = tree.0, error = %e, retry_in = ?backoff, "teardown after {why:?} failed; retrying"),
                }
                tokio::select! {
                    _ = settled.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(60));
            }
        });
    }
}
