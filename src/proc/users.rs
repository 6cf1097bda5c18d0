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
