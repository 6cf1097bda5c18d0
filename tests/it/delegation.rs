//! Delegation done right (proc/delegation.rs), on the host and in the
//! kernel lane's guest (tests/vm/run).
//!
//! cgroup v2's "no internal processes" rule, shown for real: a non-root
//! cgroup with a controller enabled for its children refuses a process of
//! its own, and one with a process of its own refuses to enable a
//! controller. On this host the v2 hierarchy offers only `hugetlb`, which is
//! enough to show both, and that a refused spawn leaves its parent as it
//! found it. The product's side: a process alone in a delegated cgroup (as
//! systemd starts the unit) moves itself into `<cgroup>/supervisor` and
//! makes tree cgroups as siblings; one sharing its cgroup with other
//! processes refuses limits with one line.
//!
//! The tests that need every controller (limits enforced, OOM, cpu
//! throttling) run only where the hierarchy offers them (the lane's guest);
//! elsewhere each prints "skipped: <why>".

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use treewarden::proc::{self, CgroupSetting, SpawnSpec, SpawnStdio};

use crate::util::{bin, is_root, skip, wait_until};

static SEQ: AtomicUsize = AtomicUsize::new(0);
/// The tests that enable `hugetlb` in the hierarchy's root take turns.
static HUGETLB: Mutex<()> = Mutex::new(());

/// A test cgroup, removed (children first) on every path.
struct TestCgroup {
    path: PathBuf,
    /// Processes this test moved in, ended by pid on drop.
    pids: Vec<u32>,
    children: Vec<std::process::Child>,
}

impl TestCgroup {
    fn new(parent: &Path, tag: &str) -> Option<TestCgroup> {
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let path = parent.join(format!("tw-test-{tag}-{}-{n}", std::process::id()));
        match std::fs::create_dir(&path) {
            Ok(()) => Some(TestCgroup {
                path,
                pids: Vec::new(),
                children: Vec::new(),
            }),
            Err(e) => {
                skip(&format!(
                    "cannot make a test cgroup under {}: {e}",
                    parent.display()
                ));
                None
            }
        }
    }

    fn file(&self, name: &str) -> String {
        std::fs::read_to_string(self.path.join(name)).unwrap_or_default()
    }

    fn procs(&self) -> Vec<i32> {
        self.file("cgroup.procs")
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// A `sleep` of ours moved into this cgroup: a process of its own.
    fn hold_a_process(&mut self) -> std::io::Result<()> {
        let child = Command::new("sleep")
            .arg("600")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()?;
        let pid = child.id();
        self.children.push(child);
        std::fs::write(self.path.join("cgroup.procs"), pid.to_string())?;
        self.pids.push(pid);
        Ok(())
    }

    /// `program args` started as systemd starts a unit's main process: it
    /// joins this cgroup, then execs.
    fn command_inside(&self, program: &Path, args: &[&str]) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg("echo $$ > \"$0/cgroup.procs\" && exec \"$@\"")
            .arg(&self.path)
            .arg(program)
            .args(args);
        c
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = wait_until(Duration::from_secs(5), || {
            proc::remove_cgroup_if_empty(&self.path).unwrap_or(false)
        });
    }
}

/// Enables `hugetlb` for the children of `parent` for the test's length
/// (and disables it again if the test enabled it).
struct HugetlbOffered {
    parent: PathBuf,
    enabled_here: bool,
    _turn: std::sync::MutexGuard<'static, ()>,
}

impl HugetlbOffered {
    fn new(parent: &Path) -> Result<HugetlbOffered, String> {
        let turn = HUGETLB.lock().unwrap_or_else(|e| e.into_inner());
        let controllers =
            std::fs::read_to_string(parent.join("cgroup.controllers")).unwrap_or_default();
        if !controllers.split_whitespace().any(|c| c == "hugetlb") {
            return Err(format!("{} offers no hugetlb controller", parent.display()));
        }
        let control = parent.join("cgroup.subtree_control");
        let before = std::fs::read_to_string(&control).unwrap_or_default();
        let enabled_here = !before.split_whitespace().any(|c| c == "hugetlb");
        if enabled_here {
            std::fs::write(&control, "+hugetlb")
                .map_err(|e| format!("cannot enable hugetlb in {}: {e}", control.display()))?;
        }
        Ok(HugetlbOffered {
            parent: parent.to_path_buf(),
            enabled_here,
            _turn: turn,
        })
    }
}

impl Drop for HugetlbOffered {
    fn drop(&mut self) {
        if self.enabled_here {
            let _ = std::fs::write(self.parent.join("cgroup.subtree_control"), "-hugetlb");
        }
    }
}

/// The test cgroups' parent, or a skip line.
fn parent() -> Option<PathBuf> {
    if !is_root() {
        skip("delegation: cgroup tests need root");
        return None;
    }
    let parent = crate::util::test_cgroup_parent();
    if parent.is_none() {
        skip("delegation: no cgroup v2 hierarchy");
    }
    parent
}

/// The first `hugetlb.<size>.max` file a cgroup has.
fn hugetlb_max_file(cg: &Path) -> Option<&'static str> {
    let names = std::fs::read_dir(cg).ok()?;
    let name = names
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("hugetlb.") && n.ends_with(".max") && !n.contains("rsvd"))?;
    Some(Box::leak(name.into_boxed_str()))
}

fn held_spec(cgroup: PathBuf, settings: Vec<CgroupSetting>) -> SpawnSpec {
    SpawnSpec {
        argv: vec!["true".into()],
        cwd: None,
        env: None,
        stdio: SpawnStdio::Null,
        cgroup: Some(cgroup),
        cgroup_settings: settings,
        log_file: None,
        umask: None,
        credentials: None,
    }
}

#[test]
fn no_internal_processes_and_a_refused_spawn_leaves_its_parent_as_found() {
    let Some(parent) = parent() else { return };
    let offered = match HugetlbOffered::new(&parent) {
        Ok(o) => o,
        Err(why) => return skip(&format!("no internal processes: {why}")),
    };
    // The rule, as the kernel applies it. A cgroup with a controller
    // enabled for its children takes no process of its own (what systemd
    // hits when it puts a restarted unit's main process into an inner
    // unit cgroup)...
    let Some(mut inner) = TestCgroup::new(&parent, "inner") else {
        return;
    };
    std::fs::write(inner.path.join("cgroup.subtree_control"), "+hugetlb").expect("enable hugetlb");
    let err = inner
        .hold_a_process()
        .expect_err("an inner node refuses a process");
    assert_eq!(err.raw_os_error(), Some(libc::EBUSY), "{err}");
    std::fs::write(inner.path.join("cgroup.subtree_control"), "-hugetlb").expect("disable");
    // ...and one with a process of its own enables no controller.
    inner.hold_a_process().expect("a leaf takes a process");
    let err = std::fs::write(inner.path.join("cgroup.subtree_control"), "+hugetlb")
        .expect_err("a cgroup with processes enables no domain controller");
    assert_eq!(err.raw_os_error(), Some(libc::EBUSY), "{err}");

    // The product: a spawn whose limit the kernel refuses (a bad value,
    // after the controller was enabled for it) leaves no controller
    // enabled and no directory, so the next spawn (and a process joining
    // the parent) goes as if it never happened.
    let Some(mut root) = TestCgroup::new(&parent, "root") else {
        return;
    };
    let probe = root.path.join("probe");
    std::fs::create_dir(&probe).expect("probe cgroup");
    std::fs::write(root.path.join("cgroup.subtree_control"), "+hugetlb").expect("enable");
    let file = hugetlb_max_file(&probe);
    std::fs::remove_dir(&probe).expect("remove probe");
    std::fs::write(root.path.join("cgroup.subtree_control"), "-hugetlb").expect("disable");
    let Some(file) = file else {
        return skip("no internal processes: no hugetlb.<size>.max file (no huge page size)");
    };
    let setting = |value: &str| CgroupSetting {
        controller: "hugetlb",
        file,
        value: value.into(),
    };
    let tree = root.path.join("tw-refused");
    let refused = proc::spawn_held(&held_spec(
        tree.clone(),
        vec![setting("0"), setting("lots")],
    ));
    let err = refused.expect_err("the kernel refuses the value");
    assert!(err.to_string().contains(file), "{err}");
    assert_eq!(
        root.file("cgroup.subtree_control").trim(),
        "",
        "no controller left enabled"
    );
    assert!(!tree.exists(), "no directory left");
    // The next spawn with a good value works and gets the limit.
    let good = root.path.join("tw-good");
    let held = proc::spawn_held(&held_spec(good.clone(), vec![setting("0")])).expect("spawn");
    assert_eq!(
        std::fs::read_to_string(good.join(file))
            .unwrap_or_default()
            .trim(),
        "0"
    );
    held.cancel().expect("cancel");
    assert!(!good.exists(), "removed with its cancelled child");
    // hugetlb stays enabled in root after a spawn that used it; a spawn
    // there with a process of its own is refused, nothing left behind.
    std::fs::write(root.path.join("cgroup.subtree_control"), "-hugetlb").expect("disable");
    root.hold_a_process().expect("root takes a process");
    let refused = proc::spawn_held(&held_spec(root.path.join("tw-shared"), vec![setting("0")]));
    assert!(
        refused.is_err(),
        "no controller under a cgroup with processes"
    );
    assert_eq!(root.file("cgroup.subtree_control").trim(), "");
    assert!(!root.path.join("tw-shared").exists());
    drop(root);
    drop(inner);
    drop(offered);
}

/// `treewarden doctor --json` as a process inside `cg`.
fn doctor_inside(cg: &TestCgroup, data: &Path) -> serde_json::Value {
    let out = cg
        .command_inside(&bin(), &["doctor", "--json"])
        .env("TREEWARDEN_DATA_DIR", data)
        .env_remove("TREEWARDEN_CGROUP_ROOT")
        .output()
        .expect("doctor");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("doctor json")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_process_alone_in_a_delegated_cgroup_moves_into_its_leaf() {
    let Some(parent) = parent() else { return };
    let Some(mut unit) = TestCgroup::new(&parent, "unit") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    // doctor names the layout and changes nothing.
    let doctor = doctor_inside(&unit, &data);
    let layout = &doctor["cgroup_layout"];
    assert_eq!(layout["layout"], "delegated", "{doctor}");
    assert_eq!(
        layout["supervisor"].as_str().map(PathBuf::from),
        Some(unit.path.join("supervisor")),
        "{doctor}"
    );
    assert!(
        !unit.path.join("supervisor").exists(),
        "doctor moved nothing"
    );

    // run alone in the unit's cgroup: it moves into supervisor/, and the
    // tree's cgroup is its sibling.
    let out = unit
        .command_inside(&bin(), &["run", "--", "cat", "/proc/self/cgroup"])
        .current_dir(tmp.path())
        .env("TREEWARDEN_DATA_DIR", &data)
        .env("TREEWARDEN_BOUNDARY", "cgroup")
        .env_remove("TREEWARDEN_CGROUP_ROOT")
        .output()
        .expect("run");
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let tree_cgroup = stdout
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .expect("the tree's cgroup")
        .to_owned();
    let unit_rel = unit
        .path
        .to_string_lossy()
        .split_once("/sys/fs/cgroup")
        .map(|(_, r)| r.trim_start_matches("/unified").to_owned())
        .unwrap_or_default();
    let (dir, name) = tree_cgroup.rsplit_once('/').expect("a path");
    assert_eq!(
        dir, unit_rel,
        "the tree is the supervisor's sibling: {tree_cgroup}"
    );
    assert!(name.starts_with("tw-"), "{tree_cgroup}");
    assert!(
        unit.path.join("supervisor").is_dir(),
        "run moved into its leaf"
    );
    assert!(
        unit.procs().is_empty(),
        "the unit's cgroup holds no process of its own"
    );

    // A cgroup shared with another process: shared, and limits refused.
    unit.hold_a_process().expect("a process of its own");
    let doctor = doctor_inside(&unit, &data);
    assert_eq!(doctor["cgroup_layout"]["layout"], "shared", "{doctor}");
    assert_eq!(doctor["cgroup_layout"]["limits"], false, "{doctor}");
    let out = unit
        .command_inside(&bin(), &["run", "--pids-max", "20", "--", "true"])
        .current_dir(tmp.path())
        .env("TREEWARDEN_DATA_DIR", &data)
        .env("TREEWARDEN_BOUNDARY", "cgroup")
        .env_remove("TREEWARDEN_CGROUP_ROOT")
        .output()
        .expect("run");
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    let offered = unit.file("cgroup.controllers");
    if offered.split_whitespace().any(|c| c == "pids") {
        assert!(
            stderr.contains("other process"),
            "why, and what to do: {stderr}"
        );
    } else {
        assert!(stderr.contains("pids controller"), "{stderr}");
    }
    assert_eq!(
        unit.file("cgroup.subtree_control").trim(),
        "",
        "nothing enabled"
    );
}
