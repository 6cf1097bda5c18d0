//! The Windows suite's workload (issue 27; tests/windows.rs runs it under
//! wine): a process that writes its pid where the test reads it, ignores
//! CTRL_BREAK_EVENT (so only the forced kill ends it), spawns a child, or
//! asks for `CREATE_BREAKAWAY_FROM_JOB`. Each mode takes a marker that
//! stays in its command line, so a survivor can be found from outside.
//!
//! ```text
//! win_helper sleep <marker> <secs> <dir>        pid -> <dir>/<marker>.pid, then sleeps
//! win_helper spawn-exit <marker> <secs> <dir>   starts `sleep <marker>-child`, waits for its
//!                                               pid file, exits 0 (a root leaving a child)
//! win_helper breakaway <marker> <dir>           asks for a child outside the job: exit 3 if
//!                                               refused, 0 (and the child's pid) if allowed
//! win_helper end <pid> <start_ticks>            ends that process only if its creation time is
//!                                               still <start_ticks> (a member the ledger names):
//!                                               prints ended/gone/recycled, exit 0 (1 on error)
//! win_helper rpc-echo                           an ACP-style stdio server: each line of stdin a
//!                                               JSON-RPC request, answered on stdout by one line
//!                                               {"jsonrpc":"2.0","id":<its id>,"result":<its
//!                                               params>}; exit 0 at stdin's end
//! ```
//!
//! On other systems it says so and exits 2.

#[cfg(windows)]
fn main() {
    std::process::exit(windows::main());
}

#[cfg(not(windows))]
fn main() {
    eprintln!("win_helper: a Windows test workload (tests/windows.rs)");
    std::process::exit(2);
}

#[cfg(windows)]
mod windows {
    use std::path::{Path, PathBuf};
    use std::time::{Duration, Instant};

    fn write_pid(dir: &Path, marker: &str) {
        let tmp = dir.join(format!("{marker}.pid.tmp"));
        let done = dir.join(format!("{marker}.pid"));
        if std::fs::write(&tmp, std::process::id().to_string()).is_ok() {
            let _ = std::fs::rename(&tmp, &done);
        }
    }

    fn ignore_break() {
        // The handler says "handled" for every control event: CTRL_BREAK
        // (the teardown's first signal) and Ctrl+C do not end this process.
        if let Err(e) = treewarden::proc::forward_console_ctrl(Box::new(|_| {})) {
            eprintln!("win_helper: cannot ignore CTRL_BREAK: {e}");
        }
    }

    fn me() -> PathBuf {
        std::env::current_exe().unwrap_or_else(|_| PathBuf::from("win_helper.exe"))
    }

    /// Answers each JSON-RPC request line on stdin with its id and params,
    /// one line each, flushed at once (the peer waits for it); 0 at EOF.
    fn rpc_echo() -> i32 {
        use std::io::{BufRead, Write};
        let stdin = std::io::stdin().lock();
        let mut out = std::io::stdout().lock();
        for line in stdin.lines() {
            let Ok(line) = line else {
                return 1;
            };
            if line.trim().is_empty() {
                continue;
            }
            let answer = match serde_json::from_str::<serde_json::Value>(&line) {
                Ok(req) => serde_json::json!({
                    "jsonrpc": "2.0",
                    "id": req["id"],
                    "result": req["params"],
                }),
                Err(e) => serde_json::json!({
                    "jsonrpc": "2.0",
                    "id": null,
                    "error": { "code": -32700, "message": e.to_string() },
                }),
            };
            if writeln!(out, "{answer}")
                .and_then(|()| out.flush())
                .is_err()
            {
                return 1;
            }
        }
        0
    }

    pub fn main() -> i32 {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
        match arg(0).as_str() {
            "sleep" => {
                ignore_break();
                let secs: u64 = arg(2).parse().unwrap_or(600);
                write_pid(Path::new(&arg(3)), &arg(1));
                std::thread::sleep(Duration::from_secs(secs));
                0
            }
            "spawn-exit" => {
                let (marker, secs, dir) = (arg(1), arg(2), PathBuf::from(arg(3)));
                write_pid(&dir, &marker);
                let child = format!("{marker}-child");
                if let Err(e) = std::process::Command::new(me())
                    .args(["sleep", &child, &secs, &arg(3)])
                    .spawn()
                {
                    eprintln!("win_helper: spawn failed: {e}");
                    return 4;
                }
                let pid = dir.join(format!("{child}.pid"));
                let until = Instant::now() + Duration::from_secs(30);
                while !pid.exists() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(20));
                }
                0
            }
            "breakaway" => {
                use std::os::windows::process::CommandExt;
                const CREATE_BREAKAWAY_FROM_JOB: u32 = 0x0100_0000;
                let (marker, dir) = (arg(1), arg(2));
                let escaped = format!("{marker}-escaped");
                match std::process::Command::new(me())
                    .args(["sleep", &escaped, "600", &dir])
                    .creation_flags(CREATE_BREAKAWAY_FROM_JOB)
                    .spawn()
                {
                    Ok(c) => {
                        println!("breakaway allowed: pid {}", c.id());
                        0
                    }
                    Err(e) => {
                        println!("breakaway refused: {e}");
                        3
                    }
                }
            }
            "end" => {
                use treewarden::proc::{Delivery, Identity, Sig};
                let (Ok(pid), Ok(start_ticks)) = (arg(1).parse::<i32>(), arg(2).parse::<u64>())
                else {
                    eprintln!("win_helper: end <pid> <start_ticks>");
                    return 2;
                };
                let boot_id = treewarden::proc::boot_id()
                    .map(str::to_owned)
                    .unwrap_or_default();
                let id = Identity {
                    pid,
                    start_ticks,
                    boot_id,
                };
                // The identity is checked after the process is opened.
                match treewarden::proc::signal_process(&id, Sig::Kill) {
                    Ok(Delivery::Recycled) => println!("{pid}: recycled, left alone"),
                    Ok(Delivery::Gone) => println!("{pid}: gone"),
                    Ok(_) => println!("{pid}: ended"),
                    Err(e) => {
                        eprintln!("win_helper: end {pid}: {e}");
                        return 1;
                    }
                }
                0
            }
            "rpc-echo" => rpc_echo(),
            other => {
                eprintln!("win_helper: unknown mode {other:?}");
                2
            }
        }
    }
}
