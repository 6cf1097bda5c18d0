//! File modes where the OS has them: the ledger's files and folders are
//! made 0600/0700 on Unix; on Windows the data dir's ACL (the user's own
//! profile by default) is what keeps them private.

/// `.mode(m)` on Unix, nothing elsewhere.
pub(crate) trait Mode {
    fn mode(&mut self, mode: u32) -> &mut Self;
}

impl Mode for std::fs::OpenOptions {
    fn mode(&mut self, mode: u32) -> &mut Self {
        crate::proc::file_mode(self, mode)
    }
}

impl Mode for std::fs::DirBuilder {
    fn mode(&mut self, mode: u32) -> &mut Self {
        crate::proc::dir_mode(self, mode)
    }
}
