//! The user database, for the Unix systems alike (Linux and macOS): users
//! and groups by name and id through nix (`getpwnam_r`, `getpwuid_r`,
//! `getgrnam_r`), each user's groups (`getgrouplist`, whose signature
//! differs between the two), and this process's own uids. The credentials a
//! tree is given are each system's own (`users.rs` on Linux, the macOS
//! folder's `misc.rs`).

use nix::unistd::{Group, Uid, User};

pub use crate::proc::types::UserInfo;

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
#[cfg(target_os = "linux")]
pub fn groups_of(user: &UserInfo, gid: u32) -> std::io::Result<Vec<u32>> {
    let name = std::ffi::CString::new(user.name.as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let groups = nix::unistd::getgrouplist(&name, nix::unistd::Gid::from_raw(gid)).map_err(io)?;
    Ok(groups.into_iter().map(nix::unistd::Gid::as_raw).collect())
}

/// The groups `user` belongs to, its primary `gid` included.
#[cfg(target_os = "macos")]
pub fn groups_of(user: &UserInfo, gid: u32) -> std::io::Result<Vec<u32>> {
    let name = std::ffi::CString::new(user.name.as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // macOS's getgrouplist takes and fills `int`s; nix offers it only
    // elsewhere. Grown until the list fits (-1: too small).
    let mut n: libc::c_int = 64;
    loop {
        let mut groups: Vec<libc::c_int> = vec![0; n as usize];
        let mut got = n;
        // SAFETY: `name` is NUL-terminated; `groups` is writable for `got`
        // entries, and the call writes at most `got` and sets `got`.
        let rc = unsafe {
            libc::getgrouplist(
                name.as_ptr(),
                gid as libc::c_int,
                groups.as_mut_ptr(),
                &raw mut got,
            )
        };
        if rc == 0 {
            groups.truncate(got.max(0) as usize);
            return Ok(groups.into_iter().map(|g| g as u32).collect());
        }
        if n >= 65_536 {
            return Err(std::io::Error::other("getgrouplist: too many groups"));
        }
        n *= 4;
    }
}

/// The real uid of this process.
pub fn current_uid() -> u32 {
    Uid::current().as_raw()
}

/// The audit login uid of this process (`/proc/self/loginuid`): the user
/// who logged in, kept across `sudo` and `su`. `None` where the kernel
/// keeps none (unset, or no such file, as on macOS).
pub fn login_uid() -> Option<u32> {
    let text = std::fs::read_to_string("/proc/self/loginuid").ok()?;
    match text.trim().parse::<u32>() {
        Ok(u32::MAX) | Err(_) => None,
        Ok(uid) => Some(uid),
    }
}

/// The effective uid of this process (whether it may set another's).
pub fn effective_uid() -> u32 {
    Uid::effective().as_raw()
}
