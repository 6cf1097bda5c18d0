//! The shape of the code, checked like a compiler check: text scans of
//! `src/` and `docs/` (rust-lang/rust's tidy is the model). Two kinds of
//! rule: invariants that hold outright (SQL only in the ledger, `unsafe`
//! only in `proc`, event kinds matched only in the ledger, no work-log
//! labels), and ratchets — counts that may only go down (platform `cfg`s
//! outside the platform folder, `Engine`'s methods, what `http` reaches
//! past the service's door). A ratchet's ceiling is today's count; a change
//! that lowers the count lowers the ceiling in the same commit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use regex::Regex;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every file under `dir` (relative to the repository) whose name ends in
/// `ext`, as (relative path with `/`, text), in path order.
fn files(dir: &str, ext: &str) -> Vec<(String, String)> {
    fn walk(root: &Path, at: &Path, ext: &str, out: &mut Vec<(String, String)>) {
        let mut entries: Vec<_> = std::fs::read_dir(at)
            .unwrap_or_else(|e| panic!("read {}: {e}", at.display()))
            .map(|e| e.expect("dir entry").path())
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(root, &p, ext, out);
            } else if p.to_string_lossy().ends_with(ext) {
                let rel = p.strip_prefix(root).expect("under the repo");
                let rel = rel.to_string_lossy().replace('\\', "/");
                let text = std::fs::read_to_string(&p).expect("read source");
                out.push((rel, text));
            }
        }
    }
    let root = repo();
    let mut out = Vec::new();
    walk(&root, &root.join(dir), ext, &mut out);
    assert!(!out.is_empty(), "no {ext} files under {dir}");
    out
}

/// The lines of `text` that are code: a line whose first non-blank
/// characters are `//` is a comment and not counted.
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l))
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
}

/// `(file:line, line)` of every code line of `src/` matching `re`, in
/// the files `keep` accepts.
fn hits(re: &Regex, keep: impl Fn(&str) -> bool) -> Vec<String> {
    let mut out = Vec::new();
    for (path, text) in files("src", ".rs") {
        if !keep(&path) {
            continue;
        }
        for (n, line) in code_lines(&text) {
            if re.is_match(line) {
                out.push(format!("{path}:{n}: {}", line.trim()));
            }
        }
    }
    out
}

fn per_file(hits: &[String]) -> String {
    let mut by: BTreeMap<&str, usize> = BTreeMap::new();
    for h in hits {
        *by.entry(h.split(':').next().unwrap_or("")).or_default() += 1;
    }
    let mut v: Vec<_> = by.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    v.iter()
        .map(|(f, n)| format!("{n:4} {f}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A ratchet: `found` must not exceed `ceiling`; past it the message
/// lists where. Below it, the ceiling is to be lowered (said, not failed:
/// a count that goes down never breaks the build).
fn ratchet(what: &str, found: &[String], ceiling: usize) {
    assert!(
        found.len() <= ceiling,
        "{what}: {} found, the ceiling is {ceiling}; by file:\n{}\n{}",
        found.len(),
        per_file(found),
        found.join("\n")
    );
    if found.len() < ceiling {
        crate::util::say(&format!(
            "tidy: {what}: {} found, under its ceiling {ceiling}: lower the ceiling in tests/it/tidy.rs",
            found.len()
        ));
    }
}

#[test]
fn only_the_ledger_knows_sql() {
    let re = Regex::new(r"\brusqlite\b").expect("re");
    let found = hits(&re, |p| !p.starts_with("src/ledger/"));
    assert!(
        found.is_empty(),
        "SQL outside src/ledger/:\n{}",
        found.join("\n")
    );
}

/// `proc` is the bottom of the layers: it takes `config`'s types and names
/// nothing above it (a walk, a classification, a row or a service is its
/// callers' business).
#[test]
fn proc_names_no_layer_above_it() {
    let re = Regex::new(r"\bcrate::(scan|ledger|custody|service|http|serve|commands|cli)\b")
        .expect("re");
    let found = hits(&re, |p| p.starts_with("src/proc/"));
    assert!(
        found.is_empty(),
        "src/proc/ names a layer above it:\n{}",
        found.join("\n")
    );
}

#[test]
fn unsafe_lives_in_proc_and_every_block_says_why() {
    let re = Regex::new(r"\bunsafe\s*(\{|fn\b|impl\b)").expect("re");
    let mut outside = Vec::new();
    let mut unexplained = Vec::new();
    for (path, text) in files("src", ".rs") {
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in code_lines(&text) {
            if !re.is_match(line) {
                continue;
            }
            if !path.starts_with("src/proc/") {
                outside.push(format!("{path}:{n}: {}", line.trim()));
            }
            // The reason sits on one of the lines just above (or on the
            // line itself, or inside a doc comment's `# Safety`).
            let from = n.saturating_sub(8);
            let said = lines[from..n]
                .iter()
                .any(|l| l.contains("SAFETY") || l.contains("# Safety"));
            if !said {
                unexplained.push(format!("{path}:{n}: {}", line.trim()));
            }
        }
    }
    assert!(
        outside.is_empty(),
        "unsafe outside src/proc/:\n{}",
        outside.join("\n")
    );
    assert!(
        unexplained.is_empty(),
        "unsafe without a `// SAFETY:` line above it:\n{}",
        unexplained.join("\n")
    );
}

#[test]
fn event_kinds_are_matched_only_in_the_ledger() {
    let re = Regex::new(
        r#""(tree|member|escape|survivors|signal|kill|sweep|dispatch|token|ledger)\.[a-z_]+""#,
    )
    .expect("re");
    // File names that happen to have the shape, and custody's own tests
    // (they read the events a teardown wrote).
    let names = Regex::new(r#""(ledger\.db|tree\.html|token\.json)""#).expect("re");
    let found: Vec<String> = hits(&re, |p| {
        !p.starts_with("src/ledger/") && !p.ends_with("tests.rs") && !p.contains("_tests")
    })
    .into_iter()
    .filter(|h| !names.is_match(h) || re.find_iter(h).count() > names.find_iter(h).count())
    .collect();
    assert!(
        found.is_empty(),
        "an event kind spelled outside src/ledger/ (match on `Event`'s variants instead):\n{}",
        found.join("\n")
    );
}

#[test]
fn no_work_log_labels_in_src_or_docs() {
    // A reader of the repository cannot look up "issue 24" or "session 5":
    // the reason is written out where the rule is kept; history is git's.
    let re = Regex::new(r"(?i)\b(issue|session|round) #?[0-9]+\b").expect("re");
    let mut found = Vec::new();
    for (dir, ext) in [("src", ".rs"), ("docs", ".md")] {
        for (path, text) in files(dir, ext) {
            for (n, line) in text.lines().enumerate() {
                if re.is_match(line) {
                    found.push(format!("{path}:{}: {}", n + 1, line.trim()));
                }
            }
        }
    }
    assert!(found.is_empty(), "work-log labels:\n{}", found.join("\n"));
}

// ---- ratchets ----

/// The only files outside `src/proc/sys/` that may hold a platform `cfg`
/// (rust-lang/rust's `pal.rs` keeps the same kind of list): path, how many
/// (a ceiling, lowered with the code), and why. Any other file holds none:
/// its per-OS bodies belong in `src/proc/sys/<os>/` behind one OS-neutral
/// fn, or are a probe answer (`proc::RESERVES_PAST_END`, say).
const PLATFORM_CFG_EXCEPTIONS: &[(&str, usize, &str)] = &[
    // Where the service is built at all: Linux and Windows.
    (
        "src/lib.rs",
        3,
        "http, service and serve are built on Linux and Windows only",
    ),
    (
        "src/commands/mod.rs",
        1,
        "a #[path] switch: serve and token refuse where the service is not built",
    ),
    (
        "src/commands/serve.rs",
        1,
        "`serve` itself, where the service is built",
    ),
    (
        "src/service/mod.rs",
        1,
        "a #[path] switch: the log cap's inotify watch, or its tick on Windows",
    ),
    (
        "src/service/users.rs",
        2,
        "run-as: a socket peer's uid on Unix, refused on Windows (the peer credential types differ)",
    ),
    (
        "src/http/conn.rs",
        1,
        "a #[path] switch: the Unix socket's connection, or none on Windows",
    ),
    ("src/http/peer.rs", 1, "a test of Linux's SO_PEERCRED"),
    (
        "src/custody/spawn.rs",
        1,
        "a test of the cgroup-only shared parent",
    ),
    ("src/custody/markers.rs", 1, "a test that needs POSIX modes"),
    (
        "src/custody/teardown/lease.rs",
        1,
        "a test that needs POSIX process groups",
    ),
    (
        "src/ledger/db.rs",
        1,
        "a test reading the WAL's allocated blocks (Linux's fallocate)",
    ),
];

#[test]
fn platform_cfgs_outside_the_platform_folder_only_go_down() {
    // `cfg`, `cfg!` and `cfg_attr` naming an OS; `cfg(test)` and the like
    // are not platform gates.
    let re = Regex::new(
        r"cfg(_attr)?!?\([^\]]*\b(unix|windows|target_os|target_family|target_arch|target_env)\b",
    )
    .expect("re");
    let found = hits(&re, |p| !p.starts_with("src/proc/sys/"));
    let mut by: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for h in &found {
        by.entry(h.split(':').next().unwrap_or(""))
            .or_default()
            .push(h.clone());
    }
    for (file, hits) in &by {
        let allowed = PLATFORM_CFG_EXCEPTIONS.iter().find(|(p, _, _)| p == file);
        let Some((_, allowed, _)) = allowed else {
            panic!(
                "a platform cfg outside src/proc/sys/ in {file}, which is not on \
                 PLATFORM_CFG_EXCEPTIONS: move the per-OS body into src/proc/sys/<os>/:\n{}",
                hits.join("\n")
            );
        };
        ratchet(&format!("platform cfgs in {file}"), hits, *allowed);
    }
    for (file, allowed, _) in PLATFORM_CFG_EXCEPTIONS {
        if *allowed > 0 && !by.contains_key(file) {
            crate::util::say(&format!(
                "tidy: {file} holds no platform cfg now: take it off PLATFORM_CFG_EXCEPTIONS"
            ));
        }
    }
    ratchet("platform cfgs outside src/proc/sys/", &found, 14);
}

/// The `fn`s declared directly in `impl <ty> {` blocks (not in nested
/// items), over `src/`.
fn methods_of(ty: &str) -> Vec<String> {
    let head = Regex::new(&format!(r"^\s*impl(<[^>]*>)?\s+{ty}\s*\{{")).expect("re");
    let func = Regex::new(r"^\s*(pub(\([^)]*\))?\s+)?(async\s+)?(const\s+)?(unsafe\s+)?fn\s+(\w+)")
        .expect("re");
    let strings = Regex::new(r#""(\\.|[^"\\])*""#).expect("re");
    let mut out = Vec::new();
    for (path, text) in files("src", ".rs") {
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            if head.is_match(lines[i]) {
                let mut depth = 0i64;
                let mut j = i;
                loop {
                    let l = lines[j].split("//").next().unwrap_or("");
                    let l = strings.replace_all(l, "\"\"");
                    if depth == 1
                        && let Some(c) = func.captures(&l)
                    {
                        out.push(format!("{path}:{}: {}", j + 1, &c[6]));
                    }
                    depth += l.matches('{').count() as i64 - l.matches('}').count() as i64;
                    if (depth == 0 && j > i) || j + 1 == lines.len() {
                        break;
                    }
                    j += 1;
                }
                i = j;
            }
            i += 1;
        }
    }
    out
}

#[test]
fn the_engine_and_the_service_only_shrink() {
    ratchet("methods of impl Engine", &methods_of("Engine"), 25);
    ratchet("methods of impl Service", &methods_of("Service"), 39);
}

#[test]
fn what_http_reaches_past_the_service_only_shrinks() {
    let http = |p: &str| p.starts_with("src/http/") && p != "src/http/tests.rs";
    let read = Regex::new(r"\.read\(").expect("re");
    ratchet(
        "closures through Service::read in src/http",
        &hits(&read, http),
        0,
    );
    let direct = Regex::new(r"\b(proc|custody)::").expect("re");
    ratchet(
        "direct proc:: / custody:: in src/http",
        &hits(&direct, http),
        0,
    );
    let engine = Regex::new(r"\.engine\(\)").expect("re");
    ratchet(
        "the custody engine reached through Service in src/http",
        &hits(&engine, http),
        0,
    );
    let up = Regex::new(r"crate::http\b").expect("re");
    ratchet(
        "crate::http named in src/service",
        &hits(&up, |p| p.starts_with("src/service/")),
        0,
    );
}

#[test]
fn owner_liveness_checks_only_merge() {
    let re = Regex::new(r"\bfn (owner_gone|owner_alive|alive_on|still_alive)\b").expect("re");
    ratchet("owner liveness checks", &hits(&re, |_| true), 1);
}

#[test]
fn the_teardown_reaches_the_kernel_through_host() {
    let re = Regex::new(r"crate::proc::[a-z_]+\(").expect("re");
    let found = hits(&re, |p| {
        p.starts_with("src/custody/teardown/") || p == "src/custody/watch.rs"
    });
    ratchet(
        "direct proc calls in the teardown and the watches",
        &found,
        1,
    );
}

/// The functions of `text` over `max` lines that have no `// Over 100
/// lines on purpose:` in the comments above them, as `(line, name)`. A
/// function runs from its `fn` line to the first line that is its indent
/// and `}` (rustfmt's layout, which `cargo fmt --check` holds); a test
/// module (`#[cfg(test)]` then `mod`) ends the file's production code.
fn long_unmarked(text: &str, max: usize) -> Vec<(usize, String)> {
    let head =
        Regex::new(r"^(\s*)(pub(\([^)]*\))? )?(const )?(async )?(unsafe )?fn (\w+)").expect("re");
    let lines: Vec<&str> = text.lines().collect();
    let end = lines
        .windows(2)
        .position(|w| w[0].trim() == "#[cfg(test)]" && w[1].trim_start().starts_with("mod "))
        .unwrap_or(lines.len());
    let mut out = Vec::new();
    for (i, line) in lines[..end].iter().enumerate() {
        let Some(c) = head.captures(line) else {
            continue;
        };
        let close = format!("{}}}", &c[1]);
        let Some(len) = lines[i..end].iter().position(|l| *l == close) else {
            continue;
        };
        if len < max {
            continue;
        }
        let marked = lines[..i]
            .iter()
            .rev()
            .take_while(|l| {
                let t = l.trim_start();
                t.starts_with("//") || t.starts_with("#[")
            })
            .any(|l| l.contains("Over 100 lines on purpose:"));
        if !marked {
            out.push((i + 1, c[7].to_string()));
        }
    }
    out
}

/// ARCHITECTURE.md, "Long functions": in the core's rooms no production
/// function is over 100 lines without its reason above it, but the
/// teardown's `send`.
#[test]
fn long_functions_in_the_core_say_why() {
    let scoped = |p: &str| {
        (p.starts_with("src/custody/")
            || p.starts_with("src/ledger/")
            || (p.starts_with("src/proc/")
                && !p.starts_with("src/proc/sys/windows/")
                && !p.starts_with("src/proc/sys/macos/"))
            || p == "src/scan.rs"
            || p == "src/cli.rs")
            && !p.ends_with("tests.rs")
            && !p.ends_with("/fake.rs")
    };
    let mut found = Vec::new();
    for (path, text) in files("src", ".rs") {
        if !scoped(&path) {
            continue;
        }
        for (n, name) in long_unmarked(&text, 100) {
            if !(path == "src/custody/teardown/signal.rs" && name == "send") {
                found.push(format!("{path}:{n}: fn {name}"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "functions over 100 lines without `// Over 100 lines on purpose: …` above them:\n{}",
        found.join("\n")
    );
    let probe = "fn a() {\n".to_string() + &"    x();\n".repeat(100) + "}\n";
    assert_eq!(long_unmarked(&probe, 100), [(1, "a".to_string())]);
    let marked = format!("// Over 100 lines on purpose: a probe.\n{probe}");
    assert!(long_unmarked(&marked, 100).is_empty());
}
