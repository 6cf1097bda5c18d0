//! `run --tty`'s relay between the caller's terminal and the tree's pty.

use super::*;

/// `run --tty`'s byte relay: stdin -> the tree's terminal, the tree's
/// terminal -> stdout, and SIGWINCH -> the terminal's size. Threads, as the
/// rest of `run`; the stdin reader is left blocked in its read when run
/// ends (the process exits).
/// Made only over a pseudo-terminal (none opens on Windows or macOS).
pub(super) struct TtyRelay {
    master_in: Option<std::fs::File>,
    master_out: Option<std::fs::File>,
    master_size: Option<std::fs::File>,
    done: Option<std::sync::mpsc::Receiver<()>>,
    /// Stops following the terminal's size.
    winch: Option<Box<dyn FnOnce()>>,
}

impl TtyRelay {
    pub(super) fn new(pty: &treewarden::proc::tty::Pty) -> std::io::Result<Self> {
        Ok(Self {
            master_in: Some(pty.master().try_clone()?),
            master_out: Some(pty.master().try_clone()?),
            master_size: Some(pty.master().try_clone()?),
            done: None,
            winch: None,
        })
    }

    pub(super) fn start(&mut self) {
        use std::io::Read;
        if let Some(mut master) = self.master_out.take() {
            let (tx, rx) = std::sync::mpsc::channel();
            self.done = Some(rx);
            let _ = std::thread::Builder::new()
                .name("tw-tty-out".into())
                .spawn(move || {
                    let mut out = std::io::stdout();
                    let mut buf = [0u8; 8192];
                    // EIO once every holder of the tree's side has closed it.
                    while let Ok(n @ 1..) = master.read(&mut buf) {
                        if out.write_all(&buf[..n]).and_then(|()| out.flush()).is_err() {
                            break;
                        }
                    }
                    let _ = tx.send(());
                });
        }
        if let Some(mut master) = self.master_in.take() {
            let _ = std::thread::Builder::new()
                .name("tw-tty-in".into())
                .spawn(move || {
                    let mut input = std::io::stdin();
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = input.read(&mut buf) {
                        if master.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
        }
        if let Some(master) = self.master_size.take() {
            self.winch = treewarden::proc::follow_terminal_resizes(master);
        }
    }

    /// Waits (bounded) until the tree's output is relayed.
    pub(super) fn finish(self, limit: Duration) {
        if let Some(done) = &self.done {
            let _ = done.recv_timeout(limit);
        }
        if let Some(stop) = self.winch {
            stop();
        }
    }
}
