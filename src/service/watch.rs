//! The watch task of an owned tree: what it waits on (the root's exit, the
//! client owner's exit, the timeout, the tree's end) and the futures that
//! resolve on each; what each means for the tree is [`OwnerWatch`]'s to say.

use super::*;

impl Service {
    /// A kept tree (`"lifetime": "owner"`) after its root exited: waits
    /// for its owner's exit or its timeout, checking every scan interval
    /// whether anything of it still runs (an empty tree ends, as
    /// `RootExited`): feeds `watch` until it decides; `false` when the tree
    /// ended otherwise (killed, shutdown).
    pub(super) async fn watch_kept(
        &self,
        done: &CancellationToken,
        tree: TreeId,
        owner: Option<&crate::proc::ExitWatch>,
        deadline: Option<tokio::time::Instant>,
        watch: &mut OwnerWatch,
    ) -> bool {
        let mut every = tokio::time::interval(self.config.scan_interval);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await;
        loop {
            tokio::select! {
                _ = done.cancelled() => return false,
                _ = exited(owner) => watch.handle_owner_exit(Watched::Owner),
                _ = until(deadline) => watch.handle_timeout(now()),
                _ = every.tick() => {
                    let engine = self.engine.clone();
                    let empty = blocking(move || engine.tree_empty_now(tree)).await;
                    watch.handle_tick(empty.ok());
                }
            }
            if watch.poll() != Action::Keep {
                return true;
            }
        }
    }
}

/// Resolves when the watched process exits; never without a watch.
pub(super) async fn exited(w: Option<&crate::proc::ExitWatch>) {
    match w {
        Some(w) => w.exited().await,
        None => std::future::pending::<()>().await,
    }
}

/// How a tree's watch learns that its root exited.
pub(super) enum RootWatch {
    /// The root is this service's announced child: the reaper says when it
    /// is reaped, and no descriptor is held for it (one pidfd per
    /// live tree would be 2,000 descriptors for 2,000 trees).
    Reaped(tokio::sync::oneshot::Receiver<()>),
    /// Any other root (a tree adopted after a restart): an identity-checked
    /// pidfd.
    Pidfd(crate::proc::ExitWatch),
    /// Not watchable (pidfd_open refused it, or no pidfd): gone already.
    Gone,
}

impl RootWatch {
    pub(super) fn open(reaper: Option<&'static Reaper>, root: &Identity) -> RootWatch {
        if let Some(reaper) = reaper {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let notify: crate::proc::ExitCallback = Box::new(move |_| {
                let _ = tx.send(());
            });
            // The pid the reaper announced is this root only while its
            // start time says so (the spawn recorded both): a recycled pid
            // is watched by its pidfd below, which checks the identity.
            // Checked again once registered: a root reaped and its pid given
            // to a new child of ours between the check and the registration
            // would have the stranger's exit stand for the root's.
            if root.check() != crate::proc::Liveness::Recycled
                && reaper.on_exit(root.pid, notify).is_ok()
                && root.check() != crate::proc::Liveness::Recycled
            {
                return RootWatch::Reaped(rx);
            }
        }
        match crate::proc::open_exit_watch(root)
            .ok()
            .flatten()
            .and_then(|fd| crate::proc::ExitWatch::new(fd).ok())
        {
            Some(w) => RootWatch::Pidfd(w),
            None => RootWatch::Gone,
        }
    }
}

pub(super) async fn root_exited(root: Option<RootWatch>) {
    match root {
        Some(RootWatch::Reaped(rx)) => {
            // A dropped sender (the reaper never calls back) is no exit.
            if rx.await.is_err() {
                std::future::pending::<()>().await
            }
        }
        Some(RootWatch::Pidfd(w)) => w.exited().await,
        Some(RootWatch::Gone) | None => std::future::pending::<()>().await,
    }
}

/// Resolves at the deadline; never without one.
pub(super) async fn until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending::<()>().await,
    }
}

/// The time now, as the owner's machine takes it.
fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// Feeds `watch` the events of a tree until it decides or keeps the tree;
/// `false` when the tree ended otherwise (killed, or the service is shutting
/// down: the drain tears it down).
pub(super) async fn watch_tree(
    done: &CancellationToken,
    root: Option<RootWatch>,
    root_gone: bool,
    owner: Option<&crate::proc::ExitWatch>,
    deadline: Option<tokio::time::Instant>,
    watch: &mut OwnerWatch,
) -> bool {
    // The root's status is filled in by the caller, once known.
    if root_gone {
        watch.handle_root_exit(None);
        return true;
    }
    let root = root_exited(root);
    tokio::pin!(root);
    loop {
        tokio::select! {
            _ = done.cancelled() => return false,
            _ = exited(owner) => watch.handle_owner_exit(Watched::Owner),
            _ = &mut root => watch.handle_root_exit(None),
            _ = until(deadline) => watch.handle_timeout(now()),
        }
        if watch.poll() != Action::Keep || watch.is_kept() {
            return true;
        }
    }
}
