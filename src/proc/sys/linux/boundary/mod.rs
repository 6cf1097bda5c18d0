//! Ownership boundaries, formed at spawn (DESIGN rule 1).
//!
//! [`spawn_held`] forks a child that, before it runs anything of the command,
//! makes itself a session and process-group leader (`setsid`: pgid = sid =
//! pid), sets up stdio and cwd, closes every other inherited descriptor, and
//! then blocks on a pipe. When the tree has a cgroup the child is born in it
//! (`clone3` with `CLONE_INTO_CGROUP`), or, where the kernel refuses that,
//! the parent moves it there meanwhile. The caller can now record the tree durably and then
//! [`HeldChild::release`] it to `execve`, or [`HeldChild::cancel`] it: work
//! that cannot be recorded is never started.
//!
//! Why not `std::process::Command`: `spawn` returns only after exec, so it
//! cannot hold a child, and its `pre_exec` hook cannot wait for the parent to
//! join the child to a cgroup. The fork/exec path here follows the same
//! discipline as std: everything the child needs is allocated before `fork`,
//! and the child makes only async-signal-safe calls until `execve` or `_exit`.
//!
//! It must never: run command code before release; leave a held child behind
//! (dropping a [`HeldChild`] cancels it); remove a cgroup that still has
//! processes (the kernel refuses, and so do we).
//!
//! One file a job: types.rs what a spawn is asked for and what
//! it answers, cgroup.rs the cgroup side (discovery, the boundary a tree
//! gets, a tree cgroup made, limited and removed), prepare.rs every
//! allocation before the fork, fork.rs the child's side (clone3 or fork,
//! then the async-signal-safe path to exec), held.rs the parent's side
//! (a [`HeldChild`] from [`spawn_held`] to its release or cancel). Every
//! `unsafe` block keeps its `// SAFETY:` line beside it.

mod cgroup;
mod fork;
mod held;
mod prepare;
mod types;

pub(crate) use cgroup::probe_child_cgroup;
pub use cgroup::{
    SHARED_PARENT_MARK, cgroup_root, cgroup2_mount, check_cgroup_writable, is_shared_parent,
    own_cgroup_dir, remove_cgroup_if_empty, remove_cgroup_when_empty,
    remove_shared_parent_if_empty, resolve_boundary,
};
pub(crate) use fork::CloneArgs;
pub use fork::deny_clone3_in_this_thread;
pub use held::{HeldChild, Spawned, spawn_held};
pub use types::{BOUNDARY_KINDS, EXEC_ERRNO_IS_THE_OS, EXEC_OTHER_FAILURE};

// The files below name these as `super::delegation` and
// `super::cgroup_wait_event`, as they did when they were one file: these
// keep those paths.
use super::{cgroup_wait_event, delegation};

// The status pipe's vocabulary, shared by the child (fork.rs) and the
// parent (held.rs).
/// Messages on the status pipe: `[tag, step, errno (4 bytes, native endian)]`.
const MSG_LEN: usize = 6;
const TAG_READY: u8 = b'R';
const TAG_SETUP: u8 = b'S';
const TAG_EXEC: u8 = b'E';
const RELEASE_BYTE: u8 = b'G';
const STEP_NAMES: [&str; 8] = [
    "unknown",
    "setsid",
    "stdio",
    "chdir",
    "signal mask",
    "credentials",
    "the requester's cgroup v1",
    "the requester's limits",
];
