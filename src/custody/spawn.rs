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
    /// given before exec (issue 17); `None`: the service's own, nobody named.
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
    let Some(n) = lines else {
        return Ok(Some(bytes.to_vec()));
    };
    // The last `n` lines: a final line without its newline counts as one.
    let body = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    let cut = body
        .iter()
        .enumerate()
        .rev()
        .filter(|(_, b)| **b == b'\n')
        .nth(n.saturating_sub(1))
        .map_or(0, |(i, _)| i + 1);
    Ok(Some(if n == 0 {
        Vec::new()
    } else {
        bytes[cut..].to_vec()
    }))
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
        self.spawn_on(req, None, recorded)
    }

    /// [`Engine::spawn_with`], the root's stdio and controlling terminal
    /// being the pseudo-terminal slave `tty` when given (`run --tty`).
    // Over 100 lines on purpose: the spawn protocol (record -> fork held -> record -> commit ->
    // release, DESIGN) in its order, each failure killing the held child before it returns; one
    // frame shows the order.
    pub(crate) fn spawn_on(
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
        let boundary = self.boundary.ok_or_else(|| {
            CustodyError::Conflict("this engine only signals; it spawns nothing".into())
        })?;
        self.check_limits(boundary, &req.limits)?;
        self.check_dispatch_for(&req.owner, req.on_behalf.as_ref().map(|b| &b.requester))?;
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
        let tree = self.ledger.create_tree_with_owner(
            &owner,
            &NewTree {
                label: req.label.clone(),
                boundary: boundary.to_string(),
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
                    .map(|s| s.name().to_string()),
            },
            on_behalf.as_ref(),
        )?;
        let cgroup = match (boundary, &self.cgroup_root) {
            (b, Some(root)) if b.contained() => {
                Some(root.join(format!("{}-{}", self.cgroup_prefix, tree.0)))
            }
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
            let dir = self.data_dir.join("logs");
            if let Err(e) = super::markers::private_dir(&dir) {
                self.record_spawn_failed(tree, &format!("cannot make {}: {e}", dir.display()), 125);
                return Err(CustodyError::Proc(crate::proc::ProcError::Io(e)));
            }
            Some(log_path(&self.data_dir, tree))
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
            cgroup: cgroup.clone(),
            cgroup_settings: req
                .limits
                .cgroup_settings()
                .into_iter()
                .map(|(controller, file, value)| crate::proc::CgroupSetting {
                    controller,
                    file,
                    value,
                })
                .collect(),
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
            && let Err(e) = self.ledger.add_flag(tree, flag)
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
        if let Ok(mut set) = self.spawned_here.lock() {
            set.insert(tree.0);
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
    fn check_limits(
        &self,
        boundary: BoundaryKind,
        limits: &crate::ledger::Limits,
    ) -> Result<(), CustodyError> {
        if limits.is_empty() {
            return Ok(());
        }
        let root = match (boundary, &self.cgroup_root) {
            (b, Some(root)) if b.contained() => root,
            _ => {
                // Why there is no cgroup boundary, when it is delegation.
                let why = match self.cgroup_root.as_deref().map(crate::proc::layout) {
                    Some(l) if l.layout == crate::proc::Layout::NotDelegated => {
                        format!(" ({})", l.note)
                    }
                    _ => String::new(),
                };
                return Err(CustodyError::Unsupported(format!(
                    "limits need the cgroup boundary, and this tree would get {boundary}: refusing to start it unlimited{why}"
                )));
            }
        };
        let offered = crate::proc::cgroup_controllers(root)?;
        for (controller, file, _) in limits.cgroup_settings() {
            if !offered.iter().any(|c| c == controller) {
                return Err(CustodyError::Unsupported(format!(
                    "{file} needs the {controller} controller, which the cgroup v2 hierarchy does not offer under {} (it offers: {}): refusing to start the tree unlimited",
                    root.display(),
                    if offered.is_empty() {
                        "none".to_string()
                    } else {
                        offered.join(" ")
                    }
                )));
            }
        }
        crate::proc::check_limits_possible(root).map_err(CustodyError::Unsupported)?;
        Ok(())
    }

    fn commit_spawn(&self, tree: TreeId, held: &HeldChild) -> Result<(), CustodyError> {
        self.ledger.tree_spawned(
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

    fn record_spawn_failed(&self, tree: TreeId, reason: &str, code: i32) {
        if let Err(e) = self.ledger.tree_spawn_failed(tree, reason, code) {
            tracing::error!(tree = tree.0, error = %e, "tree.spawn_failed not recorded");
        }
    }
}
