//! Tenants among tenants, end to end: the real `treewarden serve`, its Unix
//! socket driven by curl as two real users (made with `useradd` and removed
//! on every path, `privilege::TestUser`). One user's tree that cannot be
//! settled — its forced kill's authorization refused by a held write lock,
//! or a member no signal ends — closes dispatch for that user only: the
//! other user's spawns, polled through the whole unsettled period, are
//! every one answered 201, and the stuck tree's id is never told to them.

use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::privilege::{TestUser, curl, public_dir};
use crate::serve::{Server, tool};
use crate::util::{KillOnDrop, pid_alive, say, skip, wait_until};

/// A spawn body whose tree carries the server's marker.
fn body(s: &Server, script: &str) -> Value {
    json!({
        "argv": ["sh", "-c", script],
        "env": {"TW_TEST_MARK": s.mark},
        "grace": "200ms",
    })
}

/// Spawns as `user` on the socket, one request after another, until `stop`
/// is set (and at least once); every answer is kept, and `count` counts them.
fn poll_spawns(
    sock: &Path,
    user: &TestUser,
    s: &Server,
    stop: &AtomicBool,
    count: &AtomicUsize,
) -> Vec<(u16, Value)> {
    let mut answers = Vec::new();
    loop {
        answers.push(curl(
            sock,
            Some(user),
            "POST",
            "/api/trees",
            Some(&body(s, "exit 0")),
        ));
        count.fetch_add(1, Ordering::SeqCst);
        if stop.load(Ordering::SeqCst) {
            return answers;
        }
    }
}

/// Sets its flag when dropped: a failing assertion beside the poller stops
/// it, so the scope that joins it ends.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Every answer a 201, and none names `tree`.
fn assert_all_created(who: &str, answers: &[(u16, Value)], tree: i64) {
    assert!(!answers.is_empty());
    for (status, v) in answers {
        assert_eq!(
            *status, 201,
            "{who}'s spawn while another's tree is unsettled: {v}"
        );
        assert_ne!(v["id"], tree, "{v}");
    }
}

/// A spawn as `user` is refused, naming its own tree `tree`.
fn assert_refused_naming(sock: &Path, user: &TestUser, s: &Server, tree: i64) {
    let (status, v) = curl(
        sock,
        Some(user),
        "POST",
        "/api/trees",
        Some(&body(s, "exit 0")),
    );
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["code"], "DispatchClosed", "{v}");
    assert_eq!(
        v["tree"], tree,
        "the refusal names the principal's own tree: {v}"
    );
}

/// The tree's state, read as root.
fn state_of(sock: &Path, tree: i64) -> Value {
    curl(sock, None, "GET", &format!("/api/trees/{tree}"), None).1["tree"]["state"].clone()
}

/// The events of every tree and none (`dispatch.refused` names no tree),
/// read as root.
fn all_events(sock: &Path) -> Vec<Value> {
    let (status, v) = curl(sock, None, "GET", "/api/events?limit=10000", None);
    assert_eq!(status, 200, "{v}");
    v.as_array().cloned().unwrap_or_default()
}

/// The value of one unlabelled gauge in a scrape over TCP (admin token).
fn gauge(s: &Server, name: &str) -> Option<f64> {
    let text = s.get("/metrics").text().ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} "))?.trim().parse().ok())
}

/// A tree of `user`'s, spawned on the socket, whose forced kill could not
/// be authorized: its SIGTERM ignored, its kill (by `user`) fails closed
/// while another connection holds the ledger's write lock (409, no SIGKILL,
/// its survivors left alive, the tree unsettled). The lock is released.
fn failed_closed_tree_of(a: &TestUser, s: &Server, sock: &Path) -> i64 {
    // A's tree ignores SIGTERM (its child too: an ignored signal stays
    // ignored across exec).
    let (status, v) = curl(
        sock,
        Some(a),
        "POST",
        "/api/trees",
        Some(&body(s, "trap '' TERM; sleep 300 & wait")),
    );
    assert_eq!(status, 201, "{v}; {}", s.stderr());
    let tree = v["id"].as_i64().expect("id");
    assert!(
        wait_until(Duration::from_secs(10), || s.marked().len() >= 2),
        "{:?}",
        s.marked()
    );
    // Another connection holds the ledger's write lock: A's kill cannot
    // commit its authorization, so it fails closed (no SIGKILL, the tree
    // ambiguous, dispatch closed in its scope).
    let lock = rusqlite::Connection::open(s.data_dir().join("ledger.db")).expect("open");
    lock.execute_batch("BEGIN IMMEDIATE")
        .expect("take the write lock");
    let (status, k) = curl(
        sock,
        Some(a),
        "POST",
        &format!("/api/trees/{tree}/kill?grace=200ms"),
        None,
    );
    lock.execute_batch("ROLLBACK")
        .expect("release the write lock");
    drop(lock);
    assert_eq!(status, 409, "{k}; {}", s.stderr());
    assert_eq!(k["code"], "Ambiguous", "{k}");
    assert!(
        k["error"]
            .as_str()
            .is_some_and(|e| e.contains("authority could not be written")),
        "{k}"
    );
    tree
}

#[test]
fn a_users_tree_whose_forced_kill_could_not_be_authorized_closes_dispatch_for_that_user_only() {
    let Some(a) = TestUser::create() else {
        return;
    };
    let Some(b) = TestUser::create() else {
        return;
    };
    let public = public_dir();
    let sock = public.path().join("api.sock");
    let s = Server::start(&[
        "--socket",
        sock.to_str().expect("utf-8 path"),
        "--busy-timeout",
        "500ms",
    ]);
    let tree = failed_closed_tree_of(&a, &s, &sock);
    // The gate still holds for the tree's own principal.
    assert_refused_naming(&sock, &a, &s, tree);
    // The dashboard's banner gives the runbook's first step with the
    // tree's own id, not a placeholder.
    let index = s.get("/").text().expect("index");
    assert!(
        index.contains(&format!("<code>treewarden kill {tree}</code>"))
            && !index.contains("resolve TREE"),
        "{index}"
    );

    // The unsettled period: B spawns throughout, and so do root on the
    // socket and the admin token over TCP.
    let stop = AtomicBool::new(false);
    let count = AtomicUsize::new(0);
    let answers = std::thread::scope(|scope| {
        let poller = scope.spawn(|| poll_spawns(&sock, &b, &s, &stop, &count));
        let _stop = StopOnDrop(&stop);
        let (status, v) = curl(&sock, None, "POST", "/api/trees", Some(&body(&s, "exit 0")));
        assert_eq!(status, 201, "root on the socket: {v}");
        let (status, v) = s.post("/api/trees", Some(&body(&s, "exit 0")));
        assert_eq!(status, 201, "the admin token: {v}");
        // The refusal is no oracle: B does not learn that the tree exists.
        let (status, v) = curl(&sock, Some(&b), "GET", &format!("/api/trees/{tree}"), None);
        assert_eq!(status, 404, "{v}");
        assert!(
            wait_until(Duration::from_secs(60), || count.load(Ordering::SeqCst)
                >= 8),
            "B's polls"
        );
        // Still unsettled for A at the end of the period.
        assert_refused_naming(&sock, &a, &s, tree);
        stop.store(true, Ordering::SeqCst);
        poller.join().expect("poller")
    });
    say(&format!(
        "{} spawns by another user while tree {tree} was unsettled",
        answers.len()
    ));
    assert_all_created("B", &answers, tree);

    // Each refusal recorded who was refused: A, never B.
    let refused: Vec<Value> = all_events(&sock)
        .into_iter()
        .filter(|e| e["kind"] == "dispatch.refused")
        .collect();
    assert!(refused.len() >= 2, "{refused:?}");
    for e in &refused {
        assert_eq!(e["data"]["tree"], tree, "{e}");
        assert_eq!(e["data"]["by"]["uid"], a.uid, "{e}");
        assert_eq!(e["data"]["by"]["via"], "socket", "{e}");
    }

    // With the ledger writable, A's kill settles the tree and its own
    // dispatch opens.
    let (status, k) = curl(
        &sock,
        Some(&a),
        "POST",
        &format!("/api/trees/{tree}/kill?grace=200ms"),
        None,
    );
    assert_eq!(status, 200, "{k}; {}", s.stderr());
    assert_eq!(state_of(&sock, tree), "ended");
    let (status, v) = curl(
        &sock,
        Some(&a),
        "POST",
        "/api/trees",
        Some(&body(&s, "exit 0")),
    );
    assert_eq!(status, 201, "{v}");
    assert!(
        wait_until(Duration::from_secs(20), || s.marked().is_empty()),
        "left: {:?}",
        s.marked()
    );
}

#[test]
fn under_the_host_wide_gate_a_refusal_names_the_tree_only_to_whom_may_see_it() {
    let Some(a) = TestUser::create() else {
        return;
    };
    let Some(b) = TestUser::create() else {
        return;
    };
    let public = public_dir();
    let sock = public.path().join("api.sock");
    let s = Server::start(&[
        "--socket",
        sock.to_str().expect("utf-8 path"),
        "--busy-timeout",
        "500ms",
        "--dispatch-scope",
        "host",
    ]);
    let tree = failed_closed_tree_of(&a, &s, &sock);
    // The operator's choice: every spawn is refused. B is told that, not
    // which tree or why (B's GET of it answers 404).
    let (status, v) = curl(
        &sock,
        Some(&b),
        "POST",
        "/api/trees",
        Some(&body(&s, "exit 0")),
    );
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["code"], "DispatchClosed", "{v}");
    assert!(v["tree"].is_null(), "{v}");
    let said = v["error"].as_str().expect("error");
    assert!(
        !said.contains(&format!("tree {tree}")) && !said.contains("authority"),
        "{v}"
    );
    let (status, v) = curl(&sock, Some(&b), "GET", &format!("/api/trees/{tree}"), None);
    assert_eq!(status, 404, "{v}");
    // Its own principal and root (an admin, who reads every tree) are told.
    assert_refused_naming(&sock, &a, &s, tree);
    let (status, v) = curl(&sock, None, "POST", "/api/trees", Some(&body(&s, "exit 0")));
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["tree"], tree, "{v}");
    let (status, k) = curl(
        &sock,
        Some(&a),
        "POST",
        &format!("/api/trees/{tree}/kill?grace=200ms"),
        None,
    );
    assert_eq!(status, 200, "{k}; {}", s.stderr());
    let (status, v) = curl(
        &sock,
        Some(&b),
        "POST",
        "/api/trees",
        Some(&body(&s, "exit 0")),
    );
    assert_eq!(status, 201, "{v}");
    assert!(
        wait_until(Duration::from_secs(20), || s.marked().is_empty()),
        "left: {:?}",
        s.marked()
    );
}

/// Why this host cannot give an unprivileged user a user + pid namespace,
/// or the Python it needs to `setns` into one (`None`: it can).
fn namespaces_unavailable(user: &TestUser) -> Option<String> {
    if let Ok(v) = std::fs::read_to_string("/proc/sys/kernel/unprivileged_userns_clone")
        && v.trim() == "0"
    {
        return Some("kernel.unprivileged_userns_clone is 0".into());
    }
    match std::fs::read_to_string("/proc/sys/user/max_user_namespaces") {
        Ok(v) if v.trim() == "0" => return Some("user.max_user_namespaces is 0".into()),
        Ok(_) => {}
        Err(e) => return Some(format!("user.max_user_namespaces: {e}")),
    }
    if tool("unshare").is_none() {
        return Some("unshare not installed".into());
    }
    if !Path::new("/usr/bin/python3").is_file() {
        return Some("/usr/bin/python3 not installed".into());
    }
    let out = Command::new("setpriv")
        .arg(format!("--reuid={}", user.uid))
        .arg(format!("--regid={}", user.gid))
        .args(["--clear-groups", "unshare", "-Urpf", "true"])
        .current_dir("/")
        .output()
        .expect("setpriv");
    (!out.status.success()).then(|| {
        format!(
            "an unprivileged user cannot make a user + pid namespace here: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })
}

/// Joins the user and pid namespaces of the process named by argv[1],
/// forks a child into the pid namespace that exits at once, and never
/// reaps it: while that zombie lives, the namespace's init, once killed,
/// waits in the kernel (`zap_pid_ns_processes`). Python 3.11 has no
/// `os.setns`: ctypes.
const SETNS_HELPER: &str = r#"
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
target = int(sys.argv[1])
for ns, flag in (("user", 0x10000000), ("pid", 0x20000000)):
    fd = os.open(f"/proc/{target}/ns/{ns}", os.O_RDONLY)
    if libc.setns(fd, flag) != 0:
        print(f"setns {ns}: {os.strerror(ctypes.get_errno())}", flush=True)
        sys.exit(3)
    os.close(fd)
if os.fork() == 0:
    os._exit(0)
print("zombie", flush=True)
time.sleep(600)
"#;

/// The children of `pid` (`/proc/<pid>/task/<pid>/children`).
fn children_of(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[test]
fn a_member_no_signal_ends_is_a_typed_finding_that_closes_dispatch_for_its_own_user_only() {
    let Some(a) = TestUser::create() else {
        return;
    };
    let Some(b) = TestUser::create() else {
        return;
    };
    if let Some(why) = namespaces_unavailable(&a) {
        skip(&why);
        return;
    }
    let public = public_dir();
    let sock = public.path().join("api.sock");
    let helper_py = public.path().join("setns_helper.py");
    std::fs::write(&helper_py, SETNS_HELPER).expect("helper");
    std::fs::set_permissions(
        &helper_py,
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .expect("chmod");
    let s = Server::start(&["--socket", sock.to_str().expect("utf-8 path")]);
    // A's tree: a user + pid namespace whose init is `sleep` (which, as a
    // namespace's init, ignores SIGTERM from outside).
    let spawn = json!({
        "argv": ["unshare", "-Urpf", "sleep", "600"],
        "env": {"TW_TEST_MARK": s.mark},
        "grace": "200ms",
    });
    let (status, v) = curl(&sock, Some(&a), "POST", "/api/trees", Some(&spawn));
    assert_eq!(status, 201, "{v}; {}", s.stderr());
    let tree = v["id"].as_i64().expect("id");
    let root = v["root_pid"].as_i64().expect("root") as i32;
    let mut init = None;
    assert!(
        wait_until(Duration::from_secs(10), || {
            init = children_of(root).into_iter().find(|c| {
                std::fs::read_to_string(format!("/proc/{c}/comm"))
                    .is_ok_and(|n| n.trim() == "sleep")
            });
            init.is_some()
        }),
        "the namespace's init"
    );
    let init = init.expect("init");
    // Outside the tree, as A: the never-reaped zombie in its namespace.
    let mut helper = KillOnDrop(
        Command::new("setpriv")
            .arg(format!("--reuid={}", a.uid))
            .arg(format!("--regid={}", a.gid))
            .args(["--clear-groups", "/usr/bin/python3"])
            .arg(&helper_py)
            .arg(init.to_string())
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("helper"),
    );
    let mut line = String::new();
    std::io::BufReader::new(helper.0.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the helper's line");
    if line.trim() != "zombie" {
        skip(&format!(
            "the user cannot join its own namespaces: {}",
            line.trim()
        ));
        return;
    }

    // A kills its tree while B spawns, through the whole unsettled period.
    let stop = AtomicBool::new(false);
    let count = AtomicUsize::new(0);
    let (answers, kill) = std::thread::scope(|scope| {
        let poller = scope.spawn(|| poll_spawns(&sock, &b, &s, &stop, &count));
        let _stop = StopOnDrop(&stop);
        let kill = curl(
            &sock,
            Some(&a),
            "POST",
            &format!("/api/trees/{tree}/kill?grace=200ms"),
            None,
        );
        // The member lives on after the kill's answer: more of B's spawns,
        // and root's and the admin token's.
        let after = count.load(Ordering::SeqCst);
        let (status, v) = curl(&sock, None, "POST", "/api/trees", Some(&body(&s, "exit 0")));
        assert_eq!(status, 201, "root on the socket: {v}");
        let (status, v) = s.post("/api/trees", Some(&body(&s, "exit 0")));
        assert_eq!(status, 201, "the admin token: {v}");
        let (status, v) = curl(&sock, Some(&b), "GET", &format!("/api/trees/{tree}"), None);
        assert_eq!(status, 404, "{v}");
        assert!(
            wait_until(Duration::from_secs(60), || count.load(Ordering::SeqCst)
                >= after + 5),
            "B's polls"
        );
        assert!(pid_alive(init), "the member no signal ends still lives");
        stop.store(true, Ordering::SeqCst);
        (poller.join().expect("poller"), kill)
    });
    say(&format!(
        "{} spawns by another user while tree {tree} held a member no signal ends",
        answers.len()
    ));
    assert_all_created("B", &answers, tree);
    let (status, k) = kill;
    assert_eq!(status, 409, "{k}; {}", s.stderr());
    assert_eq!(k["code"], "Ambiguous", "{k}");
    assert!(
        k["error"]
            .as_str()
            .is_some_and(|e| e.contains(&format!("unkillable: pid {init} "))),
        "the outcome says so: {k}"
    );
    assert_refused_naming(&sock, &a, &s, tree);

    // The finding: typed, with the kernel's evidence, once.
    let (status, events) = curl(
        &sock,
        None,
        "GET",
        &format!("/api/events?tree={tree}"),
        None,
    );
    assert_eq!(status, 200, "{events}");
    let found: Vec<&Value> = events
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["kind"] == "member.unkillable")
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    let f = &found[0]["data"];
    assert_eq!(f["identity"]["pid"], init, "{f}");
    assert_eq!(f["state"], "S", "{f}");
    // (where the kernel shows it: the init waits for its namespace to empty)
    assert_eq!(f["wchan"], "zap_pid_ns_processes", "{f}");
    assert!(f["kills"].as_u64().is_some_and(|n| n >= 1), "{f}");
    assert!(f["authorization"].as_i64().is_some(), "{f}");
    let (_, detail) = curl(&sock, None, "GET", &format!("/api/trees/{tree}"), None);
    assert!(
        detail["tree"]["flags"]
            .as_array()
            .is_some_and(|fl| fl.iter().any(|x| x == "unkillable")),
        "{detail}"
    );
    // The operator's alert names it.
    assert_eq!(gauge(&s, "treewarden_unkillable_tree"), Some(tree as f64));

    // The zombie's parent gone, the namespace empties and the member ends;
    // the tree settles (its watch task tries again, and so does A).
    let helper_pid = helper.id() as i32;
    drop(helper);
    assert!(!pid_alive(helper_pid));
    assert!(
        wait_until(Duration::from_secs(10), || !pid_alive(init)),
        "the init ends once its namespace is empty"
    );
    let _ = curl(
        &sock,
        Some(&a),
        "POST",
        &format!("/api/trees/{tree}/kill?grace=200ms"),
        None,
    );
    assert!(
        wait_until(Duration::from_secs(60), || state_of(&sock, tree) == "ended"),
        "{}",
        state_of(&sock, tree)
    );
    assert_eq!(gauge(&s, "treewarden_unkillable_tree"), Some(0.0));
    let (status, v) = curl(
        &sock,
        Some(&a),
        "POST",
        "/api/trees",
        Some(&body(&s, "exit 0")),
    );
    assert_eq!(status, 201, "{v}");
    assert!(
        wait_until(Duration::from_secs(20), || s.marked().is_empty()),
        "left: {:?}",
        s.marked()
    );
}
