//! The spawn protocol: record, fork held, record what the kernel gave us,
//! commit, release.
//!
//! 1. the dispatch gate;
//! 2. owner + tree row (`spawning`), committed together with synchronous=FULL;
//! 3. fork into the boundary, the child held on its pipe;
//! 4. pid, pgid, sid, cgroup and the root's identity committed (`tree.spawned`,
//!    FULL) — this commit is what releases the child;
//! 5. release to exec; an exec failure is `tree.spawn_failed` (126/127).
//!
//! If step 2 or 4 fails, the held child is killed before it runs anything.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use super::{CustodyError, Engine};
use crate::ledger::{IdentityRecord, NewTree, OwnerKind, OwnerRecord, SpawnRecord, TreeId};
use crate::proc::{BoundaryKind, HeldChild, Identity, SpawnSpec, SpawnStdio};

/// The environment variable that tells every process of a tree its id.
pub const TREE_ID_VAR: &str = "TREEWARDEN_TREE_ID";

/// What to run and on whose behalf.
#[derive(Clone, Debug)]
pub struct SpawnRequest {
    pub argv: Vec<OsString>,
    pub label: Option<String>,
    pub cwd: Option<PathBuf>,
    /// `None` inherits this process's environment.
    pub env: Option<Vec<(OsString, OsString)>>,
    pub stdio: SpawnStdio,
    /// The process on whose behalf the tree runs (verified by the caller).
    pub owner: Identity,
    pub owner_kind: OwnerKind,
    /// The tree's grace, recorded with it: a later teardown by another
    /// process (a sweep, a restarted service) uses it. `None`: not recorded
    /// (such teardowns use their configured default).
    pub grace: Option<Duration>,
    /// The tree's timeout, recorded with it.
    pub timeout: Option<Duration>,
    /// Limits for its cgroup, set before the command runs; refused
    /// ([`CustodyError::Unsupported`]) where the boundary cannot enforce them.
    pub limits: crate::ledger::Limits,
    /// The command's umask; `None` inherits this process's.
    pub umask: Option<u32>,
    /// The teardown's first signal, recorded with the tree (a sweep that
    /// resumes the teardown sends it); `None`: SIGTERM.
    pub first_signal: Option<crate::proc::Sig>,
    /// Who asked, recorded with the tree, and the credentials its root is
    /// given before exec; `None`: the service's own, nobody named.
    pub on_behalf: Option<OnBehalf>,
}

/// Who asked for a tree, and as whom it runs.
#[derive(Clone, Debug)]
pub struct OnBehalf {
    pub requester: crate::ledger::Requester,
    /// Set in the child before exec (after the cgroup is joined, which the
    /// service still does as itself); `None`: the service's credentials.
    pub run_as: Option<crate::proc::Credentials>,
}

/// A released tree.
#[derive(Clone, Debug)]
pub struct Spawned {
    pub tree: TreeId,
    pub root: Identity,
    pub pgid: i32,
    pub sid: i32,
    pub cgroup: Option<PathBuf>,
    pub boundary: BoundaryKind,
}

/// Where a tree spawned with [`SpawnStdio::Log`] writes its stdout and
/// stderr: `<data-dir>/logs/tree-<id>.log`.
pub fn log_path(data_dir: &std::path::Path, tree: TreeId) -> PathBuf {
    data_dir.join("logs").join(format!("tree-{}.log", tree.0))
}

/// A tree's captured output: all of it, or its last `lines` lines; `None`
/// when the tree captured none (`run` passes its output through). Bytes a
/// hole-punching cap freed (zeros at the front) are skipped.
pub fn read_log(
    data_dir: &std::path::Path,
    tree: TreeId,
    lines: Option<usize>,
) -> std::io::Result<Option<Vec<u8>>> {
    // At most the last READ_MAX bytes: a log whose oldest blocks were
    // punched out (a filesystem that cannot collapse) keeps its length, and
    // reading it whole would read the holes.
    const READ_MAX: u64 = 16 << 20;
    let bytes = match std::fs::File::open(log_path(data_dir, tree)) {
        Ok(mut f) => {
            use std::io::{Read, Seek, SeekFrom};
            let len = f.metadata()?.len();
            f.seek(SeekFrom::Start(len.saturating_sub(READ_MAX)))?;
            let mut b = Vec::new();
            f.take(READ_MAX).read_to_end(&mut b)?;
            b
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let start = bytes.iter().position(|b| *b != 0).unwrap_or(bytes.len());
    let bytes = &bytes[start..];
    Ok(Some(match lines {
        None => bytes.to_vec(),
        Some(n) => last_lines(bytes, n).to_vec(),
    }))
}

/// The last `n` lines of `bytes` (a final line without its newline counts
/// as one).
pub fn last_lines(bytes: &[u8], n: usize) -> &[u8] {
    if n == 0 {
        return &[];
    }
    let body = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    let cut = body
        .iter()
        .enumerate()
        .rev()
        .filter(|(_, b)| **b == b'\n')
        .nth(n - 1)
        .map_or(0, |(i, _)| i + 1);
    &bytes[cut..]
}

/// Whose limits a check is about: one tree's (refused per spawn) or every
/// principal's (`serve --principal-*`, refused at start).
#[derive(Clone, Copy, Debug)]
pub(super) enum Whose {
    Tree,
    Principal,
}

/// The cgroup files a [`crate::ledger::Limits`] becomes.
fn settings_of(limits: &crate::ledger::Limits) -> Vec<crate::proc::CgroupSetting> {
    limits
        .cgroup_settings()
        .into_iter()
        .map(|(controller, file, value)| crate::proc::CgroupSetting {
            controller,
            file,
            value,
        })
        .collect()
}

/// Whose parent cgroup a tree joins under `serve --principal-*`: the
/// token's (`tok-<id>`), else the requesting uid's (`uid-<n>`: a socket
/// peer, the CLI), else this process's own uid (a tree nobody named asked
/// for: the service's, `run`'s).
pub(crate) fn principal_key(requester: Option<&crate::ledger::Requester>) -> String {
    match requester {
        Some(crate::ledger::Requester {
            token_id: Some(id), ..
        }) => format!("tok-{id}"),
        Some(crate::ledger::Requester { uid: Some(uid), .. }) => format!("uid-{uid}"),
        _ => format!("uid-{}", crate::proc::current_uid()),
    }
}

/// A tree's cgroup: `<root>/<prefix>-<id>`, or with a principal's key
/// `<root>/<prefix>-p-<key>/<prefix>-<id>` (the parent that key's trees
/// share; `proc::is_shared_parent` knows it by that name).
pub(crate) fn tree_cgroup_path(
    root: &std::path::Path,
    prefix: &str,
    tree: TreeId,
    principal: Option<String>,
) -> PathBuf {
    let leaf = format!("{prefix}-{}", tree.0);
    match principal {
        None => root.join(leaf),
        Some(key) => root
            .join(format!("{prefix}{}{key}", crate::proc::SHARED_PARENT_MARK))
            .join(leaf),
    }
}

/// A duration as the ledger records it (milliseconds, saturating).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub(crate) fn identity_record(id: &Identity) -> IdentityRecord {
    IdentityRecord {
        pid: id.pid,
        start_ticks: id.start_ticks,
        boot_id: id.boot_id.clone(),
    }
}

impl Engine {
    /// Spawns `req` as an owned tree. Work that cannot be recorded never starts.
    pub fn spawn(&self, req: &SpawnRequest) -> Result<Spawned, CustodyError> {
        self.spawn_with(req, &mut |_| {})
    }

    /// [`Engine::spawn`], calling `recorded` with the tree's id once its
    /// spawn is committed and before the held child is released to exec
    /// (`run --id-fd`: the caller knows the id before the command runs).
    pub fn spawn_with(
        &self,
        req: &SpawnRequest,
        recorded: &mut dyn FnMut(TreeId),
    ) -> Result<Spawned, CustodyError> {
        Spawner::new(self).spawn_on(req, None, recorded)
    }
}

/// One spawn over the engine: the limits checked, the tree recorded, the
/// child forked held, its release recorded and committed (or its failure).
pub(super) struct Spawner<'a> {
    engine: &'a Engine,
}

impl<'a> Spawner<'a> {
    pub(super) fn new(engine: &'a Engine) -> Self {
        Spawner { engine }
    }

    /// [`Engine::spawn_with`], the root's stdio and controlling terminal
    /// being the pseudo-terminal slave `tty` when given (`run --tty`).
    // Over 100 lines on purpose: the spawn protocol (record -> fork held -> record -> commit ->
    // release, DESIGN) in its order, each failure killing the held child before it returns; one
    // frame shows the order.
    pub(super) fn spawn_on(
        &self,
        req: &SpawnRequest,
        tty: Option<&std::path::Path>,
        recorded: &mut dyn FnMut(TreeId),
    ) -> Result<Spawned, CustodyError> {
        let _span = tracing::info_span!(
            "spawn",
            label = req.label.as_deref().unwrap_or(""),
            owner_kind = req.owner_kind.as_str()
        )
        .entered();
        if req.argv.is_empty() {
            return Err(CustodyError::Conflict(
                "empty command: nothing to run".into(),
            ));
        }
        let boundary = self.engine.boundary.ok_or_else(|| {
            CustodyError::Conflict("this engine only signals; it spawns nothing".into())
        })?;
        self.check_limits(boundary, &req.limits)?;
        self.engine
            .gate()
            .check_dispatch_for(&req.owner, req.on_behalf.as_ref().map(|b| &b.requester))?;
        let owner = OwnerRecord {
            identity: identity_record(&req.owner),
            kind: req.owner_kind,
        };
        let on_behalf = req
            .on_behalf
            .as_ref()
            .map(|b| crate::ledger::OnBehalfRecord {
                requester: b.requester.clone(),
                run_uid: b.run_as.as_ref().map(|c| c.uid),
                run_gid: b.run_as.as_ref().map(|c| c.gid),
            });
        // The owner row and the tree row in one FULL commit.
        let tree = self.engine.ledger.create_tree_with_owner(
            &owner,
            &NewTree {
                label: req.label.clone(),
                boundary,
                // (replaced by the owner row's id in the same transaction)
                owner: crate::ledger::OwnerId(0),
                argv: req
                    .argv
                    .iter()
                    .map(|a| a.to_string_lossy().into_owned())
                    .collect(),
                cwd: req.cwd.as_ref().map(|p| p.display().to_string()),
                grace_ms: req.grace.map(millis),
                timeout_ms: req.timeout.map(millis),
                limits: req.limits,
                first_signal: req
                    .first_signal
                    .filter(|s| *s != crate::proc::Sig::Term)
                    .map(|s| s.name().into()),
            },
            on_behalf.as_ref(),
        )?;
        // Under `serve --principal-*` the tree's cgroup sits in its
        // principal's parent, which carries what they use together.
        let shared = !self.engine.principal_limits.is_empty();
        let cgroup = match (boundary, &self.engine.cgroup_root) {
            (b, Some(root)) if b.contained() => Some(tree_cgroup_path(
                root,
                &self.engine.cgroup_prefix,
                tree,
                shared.then(|| principal_key(req.on_behalf.as_ref().map(|b| &b.requester))),
            )),
            _ => None,
        };
        // The job learns its tree id from its environment.
        let mut env: Vec<(OsString, OsString)> = req
            .env
            .clone()
            .unwrap_or_else(|| std::env::vars_os().collect());
        env.retain(|(k, _)| k != TREE_ID_VAR);
        env.push((TREE_ID_VAR.into(), tree.0.to_string().into()));
        let log_file = if req.stdio.needs_log() {
            let dir = self.engine.data_dir.join("logs");
            if let Err(e) = super::markers::private_dir(&dir) {
                self.record_spawn_failed(tree, &format!("cannot make {}: {e}", dir.display()), 125);
                return Err(CustodyError::Proc(crate::proc::ProcError::Io(e)));
            }
            Some(log_path(&self.engine.data_dir, tree))
        } else {
            None
        };
        let spec = SpawnSpec {
            credentials: req.on_behalf.as_ref().and_then(|b| b.run_as.clone()),
            tty: tty.map(std::path::Path::to_path_buf),
            log_file,
            umask: req.umask,
            argv: req.argv.clone(),
            cwd: req.cwd.clone(),
            env: Some(env),
            stdio: req.stdio.clone(),
            container: cgroup.clone(),
            cgroup_settings: settings_of(&req.limits),
            parent_settings: if shared && cgroup.is_some() {
                settings_of(&self.engine.principal_limits)
            } else {
                Vec::new()
            },
        };
        let held = match crate::proc::spawn_held(&spec) {
            Ok(held) => held,
            Err(crate::proc::ProcError::Exec(failure)) => {
                let code = failure.exit_code();
                self.record_spawn_failed(tree, &failure.to_string(), i32::from(code));
                return Err(CustodyError::Exec(failure));
            }
            Err(e) => {
                self.record_spawn_failed(tree, &format!("fork into the boundary failed: {e}"), 125);
                return Err(e.into());
            }
        };
        if let Err(e) = self.commit_spawn(tree, &held) {
            // The child has run nothing: kill it on its pipe.
            if let Err(cancel) = held.cancel() {
                tracing::error!(tree = tree.0, error = %cancel, "cancelling the held child failed");
            }
            self.record_spawn_failed(tree, &format!("could not record the spawn: {e}"), 125);
            return Err(e);
        }
        // A container that kills its members when its owner's handle closes
        // (a Windows job's KILL_ON_JOB_CLOSE) is a standing kill: it is on
        // the record before the root runs, or the root does not run.
        if let Some(flag) = crate::proc::STANDING_KILL_FLAG
            && let Err(e) = self.engine.ledger.add_flag(tree, flag)
        {
            if let Err(cancel) = held.cancel() {
                tracing::error!(tree = tree.0, error = %cancel, "cancelling the held child failed");
            }
            self.record_spawn_failed(tree, &format!("could not record {flag}: {e}"), 125);
            return Err(e.into());
        }
        let root = held.identity.clone();
        let (pgid, sid, cg) = (held.pgid, held.sid, held.cgroup.clone());
        recorded(tree);
        match held.release() {
            Ok(_) => {}
            Err(failure) => {
                let code = failure.exit_code();
                // `release` has already reaped the child and removed its
                // cgroup (`HeldChild::teardown`).
                self.record_spawn_failed(tree, &failure.to_string(), i32::from(code));
                return Err(CustodyError::Exec(failure));
            }
        }
        if let Ok(mut set) = self.engine.spawned_here.lock() {
            set.insert(tree);
        }
        tracing::info!(tree = tree.0, pid = root.pid, boundary = %boundary, "tree spawned");
        Ok(Spawned {
            tree,
            root,
            pgid,
            sid,
            cgroup: cg,
            boundary,
        })
    }

    /// Limits are enforced or refused, never pretended: they need the
    /// cgroup boundary and, for each, its controller offered to tree
    /// cgroups (`cgroup.controllers` of the cgroup root). Checked before
    /// anything is recorded or started.
    pub(super) fn check_limits(
        &self,
        boundary: BoundaryKind,
        limits: &crate::ledger::Limits,
    ) -> Result<(), CustodyError> {
        self.check_enforceable(boundary, limits, Whose::Tree)
    }

    /// [`Spawner::check_limits`] for a tree's limits or, at `serve`'s start,
    /// for the principals' (`whose` words the refusal).
    pub(super) fn check_enforceable(
        &self,
        boundary: BoundaryKind,
        limits: &crate::ledger::Limits,
        whose: Whose,
    ) -> Result<(), CustodyError> {
        if limits.is_empty() {
            return Ok(());
        }
        let root = match (boundary, &self.engine.cgroup_root) {
            (b, Some(root)) if b.contained() => root,
            _ => {
                // Why there is no cgroup boundary, when it is delegation.
                let why = match self.engine.cgroup_root.as_deref().map(crate::proc::layout) {
                    Some(l) if l.layout == crate::proc::Layout::NotDelegated => {
                        format!(" ({})", l.note)
                    }
                    _ => String::new(),
                };
                return Err(CustodyError::Unsupported(match whose {
                    Whose::Tree => format!(
                        "limits need the cgroup boundary, and this tree would get {boundary}: refusing to start it unlimited{why}"
                    ),
                    Whose::Principal => format!(
                        "principal limits (serve --principal-*) need the cgroup boundary, and trees here get {boundary}: refusing to serve without them{why}"
                    ),
                }));
            }
        };
        let offered = crate::proc::cgroup_controllers(root)?;
        for (controller, file, _) in limits.cgroup_settings() {
            if !offered.iter().any(|c| c == controller) {
                let offered = if offered.is_empty() {
                    "none".to_string()
                } else {
                    offered.join(" ")
                };
                return Err(CustodyError::Unsupported(match whose {
                    Whose::Tree => format!(
                        "{file} needs the {controller} controller, which the cgroup v2 hierarchy does not offer under {} (it offers: {offered}): refusing to start the tree unlimited",
                        root.display(),
                    ),
                    Whose::Principal => format!(
                        "serve --principal-{}-max needs the {controller} controller, which the cgroup v2 hierarchy does not offer under {} (it offers: {offered}): refusing to serve without it",
                        controller,
                        root.display(),
                    ),
                }));
            }
        }
        crate::proc::check_limits_possible(root).map_err(|e| {
            CustodyError::Unsupported(match whose {
                Whose::Tree => e,
                Whose::Principal => format!("principal limits (serve --principal-*): {e}"),
            })
        })?;
        Ok(())
    }

    pub(super) fn commit_spawn(&self, tree: TreeId, held: &HeldChild) -> Result<(), CustodyError> {
        self.engine.ledger.tree_spawned(
            tree,
            &SpawnRecord {
                root: identity_record(&held.identity),
                pgid: held.pgid,
                sid: held.sid,
                cgroup: held.cgroup.as_ref().map(|p| p.display().to_string()),
            },
        )?;
        Ok(())
    }

    pub(super) fn record_spawn_failed(&self, tree: TreeId, reason: &str, code: i32) {
        if let Err(e) = self.engine.ledger.tree_spawn_failed(tree, reason, code) {
            tracing::error!(tree = tree.0, error = %e, "tree.spawn_failed not recorded");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::Requester;

    #[test]
    fn a_principals_key_is_its_token_else_its_uid_else_this_processs() {
        let token = Requester {
            via: "tcp".into(),
            token_id: Some(7),
            token_name: Some("ci".into()),
            ..Requester::default()
        };
        let peer = Requester {
            via: "socket".into(),
            uid: Some(1000),
            pid: Some(4321),
            ..Requester::default()
        };
        assert_eq!(principal_key(Some(&token)), "tok-7");
        assert_eq!(principal_key(Some(&peer)), "uid-1000");
        let me = format!("uid-{}", crate::proc::current_uid());
        assert_eq!(principal_key(None), me);
        assert_eq!(principal_key(Some(&Requester::default())), me);
    }

    #[test]
    fn a_trees_cgroup_sits_in_its_principals_parent_only_when_one_is_named() {
        let root = std::path::Path::new("/sys/fs/cgroup/treewarden.service");
        let plain = tree_cgroup_path(root, "tw-0123abcd", TreeId(42), None);
        assert_eq!(plain, root.join("tw-0123abcd-42"));
        let shared = tree_cgroup_path(root, "tw-0123abcd", TreeId(42), Some("tok-7".into()));
        assert_eq!(shared, root.join("tw-0123abcd-p-tok-7/tw-0123abcd-42"));
        // The removal knows the parent by its name alone.
        #[cfg(target_os = "linux")]
        {
            let parent = shared.parent().expect("a parent");
            assert!(crate::proc::is_shared_parent(parent));
            assert!(!crate::proc::is_shared_parent(&shared), "a tree's cgroup");
            assert!(!crate::proc::is_shared_parent(&plain));
            assert!(!crate::proc::is_shared_parent(root));
            for other in [
                "tw-test-1-2",
                "tw-serve-test-1-p-2",
                "tw-0123abcd-p-",
                "tw-0123abcg-p-uid-1",
                "p-uid-1",
            ] {
                assert!(!crate::proc::is_shared_parent(&root.join(other)), "{other}");
            }
        }
    }
}
