//! A tree's members as a process hierarchy (issue 29): parent -> child by
//! the ppid each member had when first seen, each member marked with what
//! the ledger recorded of it (escaped, exec'd, exited, force-killed). Pure:
//! built from a [`TreeDetail`] (its member rows and typed events), drawn by
//! the dashboard (nested HTML) and `show --tree` (like `pstree`).

use std::collections::{HashMap, HashSet};

use serde::Serialize;

use super::event::Event;
use super::types::{ExitRecord, MemberRow, TreeDetail};

/// One member and the members whose first-seen parent it is.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProcessNode {
    pub pid: i32,
    pub start_ticks: u64,
    /// Its parent when first seen (`None`: not read).
    pub ppid: Option<i32>,
    pub cmdline: Vec<String>,
    /// Its executable, where it was read.
    pub exe: Option<String>,
    /// Found outside the tree's group and session.
    pub escaped: bool,
    /// Programs it ran after it was first seen (`member.exec` events).
    pub execs: u32,
    /// Found gone.
    pub exited: bool,
    /// Its exit status, where this process reaped it.
    pub exit: Option<ExitRecord>,
    /// Named in a committed kill authorization (a forced kill's target).
    pub force_killed: bool,
    pub children: Vec<ProcessNode>,
}

impl ProcessNode {
    /// The marks as words, in a fixed order (`escaped`, `exec x2`,
    /// `exited 3` / `killed by signal 9` / `exited`, `force-killed`).
    pub fn marks(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.escaped {
            v.push("escaped".to_string());
        }
        match self.execs {
            0 => {}
            1 => v.push("exec".to_string()),
            n => v.push(format!("exec x{n}")),
        }
        if self.exited {
            v.push(match self.exit {
                Some(ExitRecord {
                    signal: Some(sig), ..
                }) => format!("killed by signal {sig}"),
                Some(ExitRecord { code: Some(c), .. }) => format!("exited {c}"),
                _ => "exited".to_string(),
            });
        }
        if self.force_killed {
            v.push("force-killed".to_string());
        }
        v
    }

    /// Its program as `pstree` names it: the first word's base name (the
    /// executable's where the command line was not read).
    pub fn name(&self) -> String {
        self.cmdline
            .first()
            .or(self.exe.as_ref())
            .map(|a| a.rsplit('/').next().unwrap_or(a).to_string())
            .unwrap_or_else(|| "?".into())
    }

    /// Every node under (and with) this one, depth first.
    pub fn walk(&self) -> Vec<&ProcessNode> {
        let mut out = vec![self];
        for c in &self.children {
            out.extend(c.walk());
        }
        out
    }
}

impl TreeDetail {
    /// The members as a forest: the root first, then members whose
    /// first-seen parent is no member (reparented before first seen), each
    /// with its children in the order of their start. A member's parent is
    /// the member with its ppid that started no later than it (the newest
    /// such, where a pid was recycled).
    pub fn hierarchy(&self) -> Vec<ProcessNode> {
        let mut execs: HashMap<(i32, u64), u32> = HashMap::new();
        // The ppid as first seen is the `member.observed` event's: the
        // member row's is rewritten when the member escapes.
        let mut first_ppid: HashMap<(i32, u64), i32> = HashMap::new();
        let mut authorized: HashSet<(i32, u64)> = HashSet::new();
        for e in &self.events {
            match e.event() {
                Event::MemberObserved(m) => {
                    first_ppid
                        .entry((m.identity.pid, m.identity.start_ticks))
                        .or_insert(m.ppid);
                }
                Event::MemberExec(x) => {
                    *execs
                        .entry((x.identity.pid, x.identity.start_ticks))
                        .or_default() += 1;
                }
                Event::KillAuthorized(k) => {
                    for t in &k.targets {
                        authorized.extend(t.identities.iter().map(|i| (i.pid, i.start_ticks)));
                    }
                }
                _ => {}
            }
        }
        let mut members: Vec<&MemberRow> = self.members.iter().collect();
        members.sort_by_key(|m| (m.start_ticks, m.pid));
        let ppid_of = |m: &MemberRow| first_ppid.get(&(m.pid, m.start_ticks)).copied().or(m.ppid);
        let parent_of = |m: &MemberRow| -> Option<usize> {
            let ppid = ppid_of(m)?;
            members
                .iter()
                .enumerate()
                .filter(|(_, p)| {
                    p.pid == ppid
                        && p.start_ticks <= m.start_ticks
                        && (p.pid, p.start_ticks) != (m.pid, m.start_ticks)
                })
                .max_by_key(|(_, p)| p.start_ticks)
                .map(|(i, _)| i)
        };
        let parents: Vec<Option<usize>> = members.iter().map(|m| parent_of(m)).collect();
        let ppids: Vec<Option<i32>> = members.iter().map(|m| ppid_of(m)).collect();
        struct Known<'a> {
            members: &'a [&'a MemberRow],
            parents: &'a [Option<usize>],
            ppids: &'a [Option<i32>],
            execs: &'a HashMap<(i32, u64), u32>,
            authorized: &'a HashSet<(i32, u64)>,
        }
        fn build(i: usize, k: &Known<'_>) -> ProcessNode {
            let (members, parents, execs, authorized) =
                (k.members, k.parents, k.execs, k.authorized);
            let m = members[i];
            let key = (m.pid, m.start_ticks);
            ProcessNode {
                pid: m.pid,
                start_ticks: m.start_ticks,
                ppid: k.ppids[i],
                cmdline: m.cmdline.clone(),
                exe: m.exe.clone(),
                escaped: m.escaped_at.is_some(),
                execs: execs.get(&key).copied().unwrap_or(0),
                exited: m.exited_at.is_some(),
                exit: m.exit,
                force_killed: authorized.contains(&key),
                children: (0..members.len())
                    .filter(|c| parents[*c] == Some(i))
                    .map(|c| build(c, k))
                    .collect(),
            }
        }
        let root = self.tree.root();
        let mut tops: Vec<usize> = (0..members.len())
            .filter(|i| parents[*i].is_none())
            .collect();
        // The root first; the rest as they started.
        tops.sort_by_key(|i| {
            let m = members[*i];
            let is_root = root
                .as_ref()
                .is_some_and(|r| r.pid == m.pid && r.start_ticks == m.start_ticks);
            (!is_root, m.start_ticks, m.pid)
        });
        let known = Known {
            members: &members,
            parents: &parents,
            ppids: &ppids,
            execs: &execs,
            authorized: &authorized,
        };
        tops.into_iter().map(|i| build(i, &known)).collect()
    }
}

/// The forest as `pstree` draws it: one line per member, `├─`/`└─` under
/// its parent, `name(pid)` then its marks in brackets.
pub fn draw(forest: &[ProcessNode]) -> String {
    fn line(n: &ProcessNode) -> String {
        let marks = n.marks();
        let mut s = format!("{}({})", n.name(), n.pid);
        if !marks.is_empty() {
            s.push_str(&format!(" [{}]", marks.join(", ")));
        }
        s
    }
    fn under(n: &ProcessNode, prefix: &str, out: &mut String) {
        for (i, c) in n.children.iter().enumerate() {
            let last = i + 1 == n.children.len();
            out.push_str(prefix);
            out.push_str(if last { "└─" } else { "├─" });
            out.push_str(&line(c));
            out.push('\n');
            let deeper = format!("{prefix}{}", if last { "  " } else { "│ " });
            under(c, &deeper, out);
        }
    }
    let mut out = String::new();
    for top in forest {
        out.push_str(&line(top));
        out.push('\n');
        under(top, "", &mut out);
    }
    out
}
