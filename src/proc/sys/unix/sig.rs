//! The signals treewarden sends and their names, shared by the Unix
//! systems (Linux, macOS): each OS's `signal.rs` adds only the numbers
//! (`Sig::number`, Linux's rustix `raw`). Windows has its own `Sig`: its
//! first signal is the console break only.

pub use crate::proc::types::Sig;

impl Sig {
    /// The signals a teardown may send first (`run --signal`, `kill
    /// --signal`): never SIGKILL (that needs its authorization) nor the
    /// freeze's SIGSTOP/SIGCONT.
    pub const FIRST: [Sig; 6] = [
        Sig::Term,
        Sig::Int,
        Sig::Hup,
        Sig::Quit,
        Sig::Usr1,
        Sig::Usr2,
    ];

    /// Parses a first signal as kill(1) and timeout(1) spell it: `TERM`,
    /// `SIGTERM`, `term` or its number (`15`).
    pub fn parse_first(s: &str) -> Result<Sig, String> {
        let upper = s.trim().to_ascii_uppercase();
        let name = upper.strip_prefix("SIG").unwrap_or(&upper);
        Sig::FIRST
            .into_iter()
            .find(|sig| {
                sig.name().strip_prefix("SIG") == Some(name)
                    || name.parse::<i32>().ok() == Some(sig.number())
            })
            .ok_or_else(|| {
                format!(
                    "unknown or refused signal {s:?}: expected one of TERM, INT, HUP, QUIT, USR1, USR2 (a name or its number; KILL comes only with its authorization)"
                )
            })
    }

    /// "SIGTERM", "SIGKILL", ... (the ledger's `signal` field).
    pub fn name(self) -> &'static str {
        match self {
            Sig::Term => "SIGTERM",
            Sig::Kill => "SIGKILL",
            Sig::Stop => "SIGSTOP",
            Sig::Cont => "SIGCONT",
            Sig::Int => "SIGINT",
            Sig::Hup => "SIGHUP",
            Sig::Quit => "SIGQUIT",
            Sig::Usr1 => "SIGUSR1",
            Sig::Usr2 => "SIGUSR2",
        }
    }
}
