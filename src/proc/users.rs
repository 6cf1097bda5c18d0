//! Users and groups, for trees that run as their requester (issue 17): the
//! user database (NSS, through nix: `getpwnam_r`, `getpwuid_r`,
//! `getgrnam_r`, `getgrouplist`) and the credentials a tree's root is given
//! in the child before exec ([`super::boundary`]).
//!
//! What it must never do: guess. A uid the user database does not know
//! runs with its peer's gid and no supplementary groups, never with the
//! service's.

use nix::unistd::{Gid, Group, Uid, User};

/// The credentials set in a tree's child before exec: supplementary groups
/// first, then the gid, then the uid (real, effective and saved alike), so
/// nothing of the service's identity is left to regain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (`setgroups`); may be empty.
    pub groups: Vec<u32>,
}

/// One user as the user database knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserInfo {
    pub name: String,
    pub uid: u32,
    /// The primary group.
    pub gid: u32,
    pub home: std::path::PathBuf,
    pub shell: std::path::PathBuf,
}

impl UserInfo {
    /// A uid the user database does not know (named by number, as
    /// `systemd-run --uid` takes it): no name, its uid as its gid, `/` as
    /// its home.
    pub fn unnamed(uid: u32) -> Self {
        Self {
            name: String::new(),
            uid,
            gid: uid,
            home: "/".into(),
            shell: "/bin/sh".into(),
        }
    }
}

fn io(e: nix::Error) -> std::io::Error {
    std::io::Error::from_raw_os_error(e as i32)
}

fn info(u: User) -> UserInfo {
    UserInfo {
        name: u.name,
        uid: u.uid.as_raw(),
        gid: u.gid.as_raw(),
        home: u.dir,
        shell: u.shell,
    }
}

/// The user named `name`, if the user database has one.
pub fn user_by_name(name: &str) -> std::io::Result<Option<UserInfo>> {
    Ok(User::from_name(name).map_err(io)?.map(info))
}

/// The user with this uid, if the user database has one.
pub fn user_by_uid(uid: u32) -> std::io::Result<Option<UserInfo>> {
    Ok(User::from_uid(Uid::from_raw(uid)).map_err(io)?.map(info))
}

/// The gid of the group named `name`.
pub fn group_by_name(name: &str) -> std::io::Result<Option<u32>> {
    Ok(Group::from_name(name).map_err(io)?.map(|g| g.gid.as_raw()))
}

/// The groups `user` belongs to, its primary `gid` included
/// (`getgrouplist`, as `initgroups` would set them at login).
pub fn groups_of(user: &UserInfo, gid: u32) -> std::io::Result<Vec<u32>> {
    let name = std::ffi::CString::new(user.name.as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let groups = nix::unistd::getgrouplist(&name, Gid::from_raw(gid)).map_err(io)?;
    Ok(groups.into_iter().map(Gid::as_raw).collect())
}

/// The credentials a tree asked for by a principal with `uid` (and, from
/// its peer credentials, `gid`) runs with: the user database's groups of
/// that uid when it has one, else only `gid`.
pub fn credentials_for(uid: u32, gid: u32) -> std::io::Result<Credentials> {
    let groups = match user_by_uid(uid)? {
        Some(user) => groups_of(&user, gid)?,
        None => vec![gid],
    };
    Ok(Credentials { uid, gid, groups })
}

/// The credentials a tree asked for over the socket runs with: the peer's
/// uid and gid, and its supplementary groups *as the kernel has them for
/// the peer process* (`/proc/<pid>/status`, `Groups:`), not as the user
/// database lists them: a requester that dropped a group does not get it
/// back in its tree (issue 24). A peer whose groups cannot be read (it
/// exited, its pid is another user's now) gets none but its gid.
pub fn credentials_of_peer(pid: Option<i32>, uid: u32, gid: u32) -> Credentials {
    let groups = pid
        .and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok())
        .and_then(|status| peer_groups(&status, uid))
        .unwrap_or_else(|| vec![gid]);
    Credentials { uid, gid, groups }
}

/// The `Groups:` of a `/proc/<pid>/status` whose real uid is `uid`
/// (`None` for another uid's process: a pid reused since it connected).
fn peer_groups(status: &str, uid: u32) -> Option<Vec<u32>> {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
    };
    let real_uid: u32 = field("Uid:")?.split_whitespace().next()?.parse().ok()?;
    if real_uid != uid {
        return None;
    }
    field("Groups:")?
        .split_whitespace()
        .map(|g| g.parse().ok())
        .collect()
}

/// The real uid of this process.
pub fn current_uid() -> u32 {
    rustix::process::getuid().as_raw()
}

/// The effective uid of this process (whether it may set another's).
pub fn effective_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_groups_are_the_kernels_and_only_for_its_own_uid() {
        let status = "Name:\tsh\nUid:\t1000\t1000\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\nGroups:\t27 1000 \n";
        assert_eq!(peer_groups(status, 1000), Some(vec![27, 1000]));
        assert_eq!(peer_groups(status, 1001), None, "another uid's process");
        let none = "Uid:\t1000\t1000\t1000\t1000\nGroups:\t\n";
        assert_eq!(peer_groups(none, 1000), Some(vec![]), "dropped them all");
        // This process, read for real.
        let me = credentials_of_peer(
            Some(std::process::id() as i32),
            current_uid(),
            rustix::process::getgid().as_raw(),
        );
        let mut kernel: Vec<u32> = rustix::process::getgroups()
            .expect("getgroups")
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        let mut got = me.groups.clone();
        kernel.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, kernel);
    }

    #[test]
    fn root_is_known_and_its_groups_include_its_gid() {
        let root = user_by_uid(0).expect("lookup").expect("root exists");
        assert_eq!(root.name, "root");
        assert_eq!(user_by_name("root").expect("lookup"), Some(root.clone()));
        let c = credentials_for(0, 0).expect("credentials");
        assert!(c.groups.contains(&0), "{c:?}");
        assert_eq!(
            user_by_name("no-such-user-tw17").expect("lookup"),
            None,
            "an unknown name is None, not an error"
        );
    }

    #[test]
    fn an_unknown_uid_gets_only_its_own_gid() {
        let c = credentials_for(3_999_999_999, 3_999_999_998).expect("credentials");
        assert_eq!(c.groups, vec![3_999_999_998]);
    }
}
