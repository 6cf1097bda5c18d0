//! Delegation done right (proc/sys/linux/delegation.rs), on the host and in the
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
        container: Some(cgroup),
        cgroup_settings: settings,
        parent_settings: Vec::new(),
        log_file: None,
        umask: None,
        credentials: None,
        tty: None,
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

/// The parent several trees of one principal share (`serve
/// --principal-*`, `SpawnSpec::parent_settings`), through the held spawn:
/// made with the first tree, its limit written and its controller enabled
/// for its trees, kept while any tree is in it and removed with the last;
/// a limit the kernel refuses leaves neither it nor a controller behind.
/// `hugetlb` stands in for memory, pids and cpu (the only controller this
/// host's v2 offers); what those enforce is the kernel lane's
/// `conventions::ten_concurrent_trees_of_one_principal_…`.
#[test]
fn a_shared_parent_is_made_with_its_first_tree_limited_and_goes_with_its_last() {
    let Some(parent) = parent() else { return };
    let offered = match HugetlbOffered::new(&parent) {
        Ok(o) => o,
        Err(why) => return skip(&format!("shared parent: {why}")),
    };
    let Some(root) = TestCgroup::new(&parent, "principals") else {
        return;
    };
    let probe = root.path.join("probe");
    std::fs::create_dir(&probe).expect("probe cgroup");
    std::fs::write(root.path.join("cgroup.subtree_control"), "+hugetlb").expect("enable");
    let file = hugetlb_max_file(&probe);
    std::fs::remove_dir(&probe).expect("remove probe");
    std::fs::write(root.path.join("cgroup.subtree_control"), "-hugetlb").expect("disable");
    let Some(file) = file else {
        return skip("shared parent: no hugetlb.<size>.max file (no huge page size)");
    };
    let setting = |value: &str| CgroupSetting {
        controller: "hugetlb",
        file,
        value: value.into(),
    };
    let shared = root.path.join("tw-0123abcd-p-uid-4242");
    let spec = |n: u32, value: &str| SpawnSpec {
        parent_settings: vec![setting(value)],
        ..held_spec(shared.join(format!("tw-0123abcd-{n}")), Vec::new())
    };
    // A parent limit the kernel refuses: no tree, no parent, nothing enabled.
    let err = proc::spawn_held(&spec(1, "lots")).expect_err("the kernel refuses the value");
    assert!(err.to_string().contains(file), "{err}");
    assert!(!shared.exists(), "no parent left");
    assert_eq!(
        root.file("cgroup.subtree_control").trim(),
        "",
        "no controller left enabled"
    );
    // Two trees of the principal: one parent, limited, its controller
    // enabled for its trees (each keeps its own files).
    let first = proc::spawn_held(&spec(1, "0")).expect("the first tree");
    let read = |p: &Path| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .trim()
            .to_owned()
    };
    assert_eq!(read(&shared.join(file)), "0", "the parent's limit");
    assert!(
        read(&shared.join("cgroup.subtree_control")).contains("hugetlb"),
        "enabled for its trees"
    );
    assert!(
        shared.join("tw-0123abcd-1").join(file).exists(),
        "the tree's own file"
    );
    let second = proc::spawn_held(&spec(2, "0")).expect("the second tree");
    assert_eq!(
        first.cgroup.as_deref().and_then(Path::parent),
        Some(shared.as_path())
    );
    assert_eq!(
        second.cgroup.as_deref().and_then(Path::parent),
        Some(shared.as_path())
    );
    first.cancel().expect("cancel the first");
    assert!(
        !shared.join("tw-0123abcd-1").exists(),
        "the first tree's cgroup is gone"
    );
    assert!(shared.exists(), "the parent stays while a tree is in it");
    second.cancel().expect("cancel the second");
    assert!(!shared.exists(), "removed with its last tree");
    assert!(
        root.file("cgroup.events").contains("populated 0"),
        "{}",
        root.file("cgroup.events")
    );
    drop(root);
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

/// Whether `cg` offers tree cgroups every controller limits use; prints a
/// skip line when not (everywhere but the kernel lane's guest).
fn offers_limits(cg: &Path, what: &str) -> bool {
    let offered = std::fs::read_to_string(cg.join("cgroup.controllers")).unwrap_or_default();
    let missing: Vec<&str> = ["pids", "memory", "cpu"]
        .into_iter()
        .filter(|c| !offered.split_whitespace().any(|o| o == *c))
        .collect();
    if missing.is_empty() {
        return true;
    }
    skip(&format!(
        "{what}: {} offers no {} controller (the kernel lane's guest does: tests/vm/run)",
        cg.display(),
        missing.join("/")
    ));
    false
}

/// A `treewarden` command as the unit's main process would run it, with its
/// own data dir and the cgroup boundary, the cgroup root left to the
/// product (its own cgroup).
fn tw_inside(cg: &TestCgroup, dir: &Path, args: &[&str]) -> Command {
    let mut c = cg.command_inside(&bin(), args);
    c.current_dir(dir)
        .env("TREEWARDEN_DATA_DIR", dir.join("data"))
        .env("TREEWARDEN_BOUNDARY", "cgroup")
        .env_remove("TREEWARDEN_CGROUP_ROOT")
        .env("TREEWARDEN_BUSY_TIMEOUT", "300ms");
    c
}

fn export(dir: &Path) -> Vec<serde_json::Value> {
    let out = Command::new(bin())
        .args(["export", "--format", "ndjson"])
        .env("TREEWARDEN_DATA_DIR", dir.join("data"))
        .output()
        .expect("export");
    if !dir.join("data/ledger.db").exists() {
        return Vec::new();
    }
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    crate::util::parse_ndjson(&String::from_utf8_lossy(&out.stdout))
}

fn show(dir: &Path, id: i64) -> serde_json::Value {
    let out = Command::new(bin())
        .args(["show", &id.to_string(), "--json"])
        .env("TREEWARDEN_DATA_DIR", dir.join("data"))
        .output()
        .expect("show");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("show json")
}

/// The limits `tree.created` recorded, from `show --json`.
fn created_limits(shown: &serde_json::Value) -> serde_json::Value {
    shown["events"]
        .as_array()
        .and_then(|es| es.iter().find(|e| e["kind"] == "tree.created"))
        .map(|e| e["data"]["limits"].clone())
        .unwrap_or_default()
}

/// The `tw-*` cgroups under `cg`.
fn tree_cgroups(cg: &Path) -> Vec<String> {
    std::fs::read_dir(cg)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("tw-"))
        .collect()
}

/// The tree's own cgroup files, read by the workload itself: the ground
/// truth the record is compared with.
const OWN_CGROUP: &str = "cg=/sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup)";

#[test]
fn limits_under_a_delegated_unit_are_enforced_recorded_and_refusals_change_nothing() {
    let Some(parent) = parent() else { return };
    if !offers_limits(&parent, "limits enforced under a delegated unit") {
        return;
    }
    // A unit whose parent gives it memory and pids but not cpu: a missing
    // controller. Refused before anything is recorded; the next spawn there
    // goes as if it never happened.
    let Some(partial) = TestCgroup::new(&parent, "partial") else {
        return;
    };
    std::fs::write(partial.path.join("cgroup.subtree_control"), "+memory +pids").expect("enable");
    let Some(unit) = TestCgroup::new(&partial.path, "unit") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tw_inside(
        &unit,
        tmp.path(),
        &["run", "--cpu-max", "50%", "--", "true"],
    )
    .output()
    .expect("run");
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("cpu controller"), "{err}");
    assert!(export(tmp.path()).is_empty(), "nothing recorded");
    assert_eq!(unit.file("cgroup.subtree_control").trim(), "");
    assert!(tree_cgroups(&unit.path).is_empty());
    let out = tw_inside(
        &unit,
        tmp.path(),
        &["run", "--pids-max", "20", "--", "true"],
    )
    .output()
    .expect("run");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    drop(unit);
    drop(partial);

    // Every controller: a value the kernel refuses (pids.max above its
    // ceiling) after the controller was enabled for it. Its own
    // spawn_failed row, no controller left enabled, no directory.
    let Some(unit) = TestCgroup::new(&parent, "unit") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tw_inside(
        &unit,
        tmp.path(),
        &["run", "--pids-max", "99999999", "--", "true"],
    )
    .output()
    .expect("run");
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("pids.max"), "{err}");
    assert_eq!(
        unit.file("cgroup.subtree_control").trim(),
        "",
        "no controller left enabled"
    );
    assert!(tree_cgroups(&unit.path).is_empty(), "no directory left");
    let events = export(tmp.path());
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["kind"].as_str()).collect();
    assert!(kinds.contains(&"tree.spawn_failed"), "{kinds:?}");
    assert!(
        events
            .iter()
            .all(|e| e["tree"].as_i64().is_none_or(|t| t == 1)),
        "{kinds:?}"
    );

    // --pids-max: enforced (a subshell forks until the kernel refuses; the
    // shell then reads its cgroup with builtins only, as it cannot fork)
    // and recorded, with the peak the workload read itself.
    let script = format!(
        "{OWN_CGROUP}; (i=0; while [ $i -lt 30 ]; do sleep 2 & i=$((i+1)); done) 2>/dev/null; \
         read m < $cg/pids.max; read p < $cg/pids.peak; echo $m > pids.max; echo $p > pids.peak"
    );
    let out = tw_inside(
        &unit,
        tmp.path(),
        &["run", "--pids-max", "10", "--", "sh", "-c", &script],
    )
    .output()
    .expect("run");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    let read = |f: &str| {
        std::fs::read_to_string(tmp.path().join(f))
            .unwrap_or_default()
            .trim()
            .to_owned()
    };
    assert_eq!(read("pids.max"), "10");
    let peak: u64 = read("pids.peak").parse().expect("pids.peak");
    assert!(peak <= 10 && peak > 1, "at most 10: {peak}");
    let shown = show(tmp.path(), 2);
    assert_eq!(created_limits(&shown)["pids_max"], 10, "{shown}");
    assert!(
        shown["resources"]["pids_peak"].as_u64() >= Some(peak),
        "{shown}"
    );

    // --cpu-max: the workload burns for two seconds under 20% of a CPU and
    // reads its own cpu.max and throttling.
    let script = format!(
        "{OWN_CGROUP}; end=$(( $(date +%s) + 2 )); while [ $(date +%s) -lt $end ]; do :; done; \
         cat $cg/cpu.max > cpu.max; sed -n 's/^nr_throttled //p' $cg/cpu.stat > throttled"
    );
    let out = tw_inside(
        &unit,
        tmp.path(),
        &["run", "--cpu-max", "20%", "--", "sh", "-c", &script],
    )
    .output()
    .expect("run");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    assert_eq!(read("cpu.max"), "20000 100000");
    let throttled: u64 = read("throttled").parse().expect("nr_throttled");
    assert!(throttled > 0, "throttled under cpu.max: {throttled}");
    assert_eq!(created_limits(&show(tmp.path(), 3))["cpu_max_pct"], 20);

    // --memory-max: the workload reads its own memory.max; its peak is
    // recorded (present, not zero).
    let script = format!(
        "{OWN_CGROUP}; x=$(head -c 4000000 /dev/zero | tr '\\0' a); cat $cg/memory.max > memory.max; cat $cg/memory.peak > memory.peak"
    );
    let out = tw_inside(
        &unit,
        tmp.path(),
        &["run", "--memory-max", "48M", "--", "sh", "-c", &script],
    )
    .output()
    .expect("run");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    assert_eq!(read("memory.max"), (48u64 << 20).to_string());
    let peak: u64 = read("memory.peak").parse().expect("memory.peak");
    let shown = show(tmp.path(), 4);
    let recorded = shown["resources"]["memory_peak_bytes"]
        .as_u64()
        .expect("memory peak recorded");
    assert!(
        recorded >= peak && peak > 1_000_000,
        "recorded {recorded}, workload saw {peak}"
    );
    // Every run moved into the unit's leaf; the unit holds no process.
    assert!(unit.path.join("supervisor").is_dir());
    assert!(unit.procs().is_empty());
    assert!(tree_cgroups(&unit.path).is_empty(), "tree cgroups removed");
}

/// The shipped unit's `ExecStopPost=` command line, unescaped as systemd
/// does (`$$` is `$`, `%%` is `%`), for `sh -c`.
fn unit_exec_stop_post() -> String {
    let unit = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/treewarden.service"),
    )
    .expect("the shipped unit");
    let line = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStopPost=/bin/sh -c '"))
        .expect("the unit releases its controllers after a stop");
    line.trim_end_matches('\'')
        .replace("$$", "$")
        .replace("%%", "%")
}

/// `treewarden serve` started as systemd starts the unit's main process:
/// into the unit's own cgroup, then exec.
fn start_service(unit: &TestCgroup, dir: &Path) -> (std::process::Child, String, String) {
    let ready = dir.join("ready");
    let _ = std::fs::remove_file(&ready);
    let err = std::fs::File::create(dir.join("serve.stderr")).expect("stderr");
    let ready_s = ready.to_string_lossy().into_owned();
    let child = tw_inside(
        unit,
        dir,
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--scan-interval",
            "100ms",
            "--ready-file",
            &ready_s,
        ],
    )
    .env("TREEWARDEN_LOG", "info")
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(err)
    .spawn()
    .expect("serve");
    let up = wait_until(Duration::from_secs(30), || ready.exists());
    let log = || std::fs::read_to_string(dir.join("serve.stderr")).unwrap_or_default();
    assert!(up, "serve did not come up: {}", log());
    let addr = std::fs::read_to_string(&ready).expect("ready");
    let token = std::fs::read_to_string(dir.join("data/api-token"))
        .expect("token")
        .trim()
        .to_owned();
    (child, addr, token)
}

fn post(addr: &str, token: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let http = reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(crate::util::scaled(Duration::from_secs(30)))
        .build()
        .expect("client");
    let r = http
        .post(format!("http://{addr}/api/trees"))
        .bearer_auth(token)
        .json(body)
        .send()
        .expect("POST");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or_default())
}

#[test]
fn a_delegated_service_spawns_limited_trees_and_restarts_as_systemd_restarts_it() {
    let Some(parent) = parent() else { return };
    if !offers_limits(&parent, "a delegated service's limits and restart") {
        return;
    }
    let Some(mut unit) = TestCgroup::new(&parent, "unit") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let mark = format!(
        "tw-deleg-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    );
    let (serve, addr, token) = start_service(&unit, tmp.path());
    let serve_pid = serve.id() as i32;
    // Ended by its pid on every path (TestCgroup's drop), not only below.
    unit.children.push(serve);
    let supervisor = TestCgroup {
        path: unit.path.join("supervisor"),
        pids: Vec::new(),
        children: Vec::new(),
    };
    assert_eq!(
        supervisor.procs(),
        vec![serve_pid],
        "serve moved into its leaf"
    );
    let body = |limits: serde_json::Value| {
        serde_json::json!({
            "argv": ["/bin/sleep", "600"],
            "env": {"TW_TEST_MARK": mark},
            "grace": "200ms",
            "limits": limits,
        })
    };
    // A value the kernel refuses: refused, and it changes nothing for the
    // next spawn, with limits or without (the issue: every later spawn
    // exited 125).
    let (status, v) = post(
        &addr,
        &token,
        &body(serde_json::json!({"pids_max": 99_999_999})),
    );
    assert!(status >= 400, "{status} {v}");
    assert_eq!(
        unit.file("cgroup.subtree_control").trim(),
        "",
        "no controller left enabled"
    );
    let (status, v) = post(
        &addr,
        &token,
        &body(serde_json::json!({"pids_max": 20, "memory_max": "64M"})),
    );
    assert_eq!(status, 201, "{v}");
    let tree = v["id"].as_i64().expect("id");
    let tree_cg = v["cgroup"].as_str().map(PathBuf::from).unwrap_or_else(|| {
        let names = tree_cgroups(&unit.path);
        unit.path.join(names.first().expect("a tree cgroup"))
    });
    assert!(wait_until(
        Duration::from_secs(10),
        || crate::util::marked_processes(&mark).len() == 1
    ));
    assert_eq!(
        std::fs::read_to_string(tree_cg.join("pids.max"))
            .unwrap_or_default()
            .trim(),
        "20"
    );
    assert_eq!(
        std::fs::read_to_string(tree_cg.join("memory.max"))
            .unwrap_or_default()
            .trim(),
        (64u64 << 20).to_string()
    );

    // The service crashes (SIGKILL: no clean-up of its own). While the
    // unit's cgroup is an inner node with controllers enabled, systemd could
    // not put a new main process there:
    crate::util::signal(serve_pid as u32, rustix::process::Signal::KILL);
    if let Some(mut serve) = unit.children.pop() {
        let _ = serve.wait();
    }
    let err = unit
        .hold_a_process()
        .expect_err("an inner node takes no process");
    assert_eq!(err.raw_os_error(), Some(libc::EBUSY), "{err}");
    // systemd runs the unit's ExecStopPost= in <unit>/.control:
    let control = TestCgroup {
        path: unit.path.join(".control"),
        pids: Vec::new(),
        children: Vec::new(),
    };
    std::fs::create_dir(&control.path).expect(".control");
    let out = control
        .command_inside(Path::new("/bin/sh"), &["-c", &unit_exec_stop_post()])
        .output()
        .expect("ExecStopPost");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(unit.file("cgroup.subtree_control").trim(), "", "released");
    assert_eq!(
        crate::util::marked_processes(&mark).len(),
        1,
        "the orphaned tree still runs"
    );

    // systemd restarts it: the new main process joins the unit's cgroup
    // (now accepted), moves into its leaf, and sweeps the orphaned tree
    // with authority.
    let (serve2, addr, token) = start_service(&unit, tmp.path());
    unit.children.push(serve2);
    assert!(
        wait_until(Duration::from_secs(30), || crate::util::marked_processes(
            &mark
        )
        .is_empty()),
        "the new instance ended the orphan: {}",
        std::fs::read_to_string(tmp.path().join("serve.stderr")).unwrap_or_default()
    );
    let events = export(tmp.path());
    let of_tree = |kind: &str| {
        events
            .iter()
            .any(|e| e["tree"] == tree && e["kind"] == kind)
    };
    assert!(
        of_tree("kill.authorized") || of_tree("tree.ended"),
        "{events:?}"
    );
    // And it spawns limited trees again.
    let (status, v) = post(&addr, &token, &body(serde_json::json!({"pids_max": 5})));
    assert_eq!(status, 201, "{v}");
    assert!(wait_until(
        Duration::from_secs(10),
        || crate::util::marked_processes(&mark).len() == 1
    ));
    assert!(unit.file("cgroup.subtree_control").contains("pids"));
    // A clean stop: the service ends its own trees.
    if let Some(child) = unit.children.last() {
        crate::util::signal(child.id(), rustix::process::Signal::TERM);
    }
    if let Some(mut child) = unit.children.pop() {
        let _ = crate::util::wait_child(&mut child, Duration::from_secs(30));
    }
    assert!(wait_until(Duration::from_secs(10), || {
        crate::util::marked_processes(&mark).is_empty()
    }));
    crate::util::end_marked(&mark);
    drop(control);
    drop(supervisor);
}

/// The unprivileged user the tests act as (`nobody`: its home is
/// `/nonexistent`).
const NOBODY: u32 = 65534;

/// `treewarden args` as `nobody`, moved into `cg` by root first (a process
/// may move itself only between cgroups whose common ancestor it may write,
/// so the session manager places it, as systemd does), without `$HOME`,
/// with `$XDG_RUNTIME_DIR` at `runtime`.
fn as_nobody_inside(cg: &Path, runtime: &Path, args: &[&str]) -> Command {
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg("echo $$ > \"$0/cgroup.procs\" && exec \"$@\"")
        .arg(cg)
        .args([
            "setpriv",
            "--reuid",
            &NOBODY.to_string(),
            "--regid",
            &NOBODY.to_string(),
            "--clear-groups",
        ])
        .arg(bin())
        .args(args)
        .current_dir(runtime)
        .env_remove("HOME")
        .env_remove("XDG_STATE_HOME")
        .env_remove("TREEWARDEN_DATA_DIR")
        .env_remove("TREEWARDEN_CGROUP_ROOT")
        .env_remove("TREEWARDEN_BOUNDARY")
        .env("XDG_RUNTIME_DIR", runtime);
    c
}

fn chown_nobody(path: &Path) {
    std::os::unix::fs::chown(path, Some(NOBODY), Some(NOBODY))
        .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
}

#[test]
fn an_unprivileged_user_gets_limits_where_systemd_delegates_and_a_clear_refusal_elsewhere() {
    let Some(parent) = parent() else { return };
    if Command::new("setpriv").arg("--version").output().is_err() {
        return skip("unprivileged limits: no setpriv");
    }
    // A user runtime dir as pam_systemd makes it: theirs, 0700.
    let runtime = tempfile::tempdir().expect("tempdir");
    chown_nobody(runtime.path());
    std::fs::set_permissions(
        runtime.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .expect("chmod");

    // Not delegated (a cgroup root owns): the session boundary, and limits
    // refused in one line that says why. $HOME unset and the user's home
    // /nonexistent: the ledger goes to $XDG_RUNTIME_DIR/treewarden.
    let Some(other) = TestCgroup::new(&parent, "notdeleg") else {
        return;
    };
    let out = as_nobody_inside(
        &other.path,
        runtime.path(),
        &["run", "--pids-max", "10", "--", "true"],
    )
    .output()
    .expect("run");
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("not delegated"), "why: {err}");
    let out = as_nobody_inside(&other.path, runtime.path(), &["run", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    assert!(
        runtime.path().join("treewarden/ledger.db").is_file(),
        "no $HOME: the data dir falls back to $XDG_RUNTIME_DIR/treewarden"
    );
    drop(other);

    if !offers_limits(&parent, "unprivileged limits under user@UID.service") {
        return;
    }
    // user@UID.service: systemd delegates it by chown (the directory and
    // its cgroup.procs, cgroup.subtree_control, cgroup.threads).
    let Some(user) = TestCgroup::new(&parent, "user") else {
        return;
    };
    for f in [
        "",
        "cgroup.procs",
        "cgroup.subtree_control",
        "cgroup.threads",
    ] {
        chown_nobody(&user.path.join(f));
    }
    let script = format!("{OWN_CGROUP}; read m < $cg/pids.max; echo $m");
    let out = as_nobody_inside(
        &user.path,
        runtime.path(),
        &["run", "--pids-max", "10", "--", "sh", "-c", &script],
    )
    .output()
    .expect("run");
    let (stdout, err) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(stdout.trim(), "10", "the tree's own pids.max");
    assert!(user.path.join("supervisor").is_dir(), "moved into its leaf");
}
