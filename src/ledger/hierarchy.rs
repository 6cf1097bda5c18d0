//! A tree's members as a process hierarchy: parent -> child by
//! the ppid each member had when first seen, each member marked with what
//! the ledger recorded of it (escaped, exec'd, exited, force-killed or kill
//! authorized). Pure: built from a [`TreeDetail`] (its member rows, signal
//! and authorization rows and typed events), drawn by the dashboard (nested
//! HTML) and `show --tree` (like `pstree`).
//!
//! The depth is the process chain's, which the tree controls: the build is
//! an index (pid -> members, member -> children) and an iterative walk, and
//! nesting stops at [`MAX_DEPTH`]: a member that deep is drawn with every
//! member below it as its direct children, flat, in the order they started
//! (each keeps its `ppid`), and says how many it holds so
//! ([`ProcessNode::flattened`]). So nothing that walks the forest (drawing,
//! JSON, drop) goes deeper than `MAX_DEPTH + 1`.

use std::collections::HashMap;

use serde::Serialize;

use super::event::Event;
use super::types::{ExitRecord, MemberRow, TreeDetail};

/// Levels of nesting drawn; deeper members are drawn flat under the member
/// at this depth (the root is depth 0).
pub const MAX_DEPTH: usize = 64;

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
    /// A forced signal reached it, as the record shows: a `signal.sent` row
    /// of a kill authorization naming it, delivered to the target that
    /// names it, and nothing recorded that says it ended otherwise (an exit
    /// found before that signal, or an exit status other than SIGKILL's).
    pub force_killed: bool,
    /// Named in a committed kill authorization where the record does not
    /// show the forced signal reaching it (none sent or delivered for its
    /// target, or it had exited first).
    pub kill_authorized: bool,
    /// Members deeper than [`MAX_DEPTH`] drawn flat as this node's
    /// children (0: its children are its own).
    pub flattened: usize,
    pub children: Vec<ProcessNode>,
}

impl ProcessNode {
    /// The marks as words, in a fixed order (`escaped`, `exec x2`,
    /// `exited 3` / `killed by signal 9` / `exited`, `force-killed` /
    /// `kill authorized`, `N deeper members drawn flat`).
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
        } else if self.kill_authorized {
            v.push("kill authorized".to_string());
        }
        if self.flattened > 0 {
            v.push(format!(
                "{} deeper members drawn flat (depth cap {MAX_DEPTH})",
                self.flattened
            ));
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

    /// Every node under (and with) this one, depth first (iterative).
    pub fn walk(&self) -> Vec<&ProcessNode> {
        let mut out = Vec::new();
        let mut stack = vec![self];
        while let Some(n) = stack.pop() {
            out.push(n);
            stack.extend(n.children.iter().rev());
        }
        out
    }
}

type Key = (i32, u64);

impl TreeDetail {
    /// For each identity a kill authorization named, when the first forced
    /// signal delivered to a target naming it was recorded (`None`: named,
    /// but no such signal is recorded).
    fn forced_reach(&self) -> HashMap<Key, Option<&str>> {
        let mut reach: HashMap<Key, Option<&str>> = HashMap::new();
        for a in &self.authorizations {
            for t in &a.targets {
                let sent = self
                    .signals
                    .iter()
                    .filter(|s| {
                        s.authorization == Some(a.id)
                            && s.target_kind == t.kind
                            && s.target == t.target
                            && s.result.delivered()
                    })
                    .map(|s| s.at.as_str())
                    .min();
                for i in &t.identities {
                    let e = reach.entry((i.pid, i.start_ticks)).or_insert(None);
                    *e = match (*e, sent) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                }
            }
        }
        reach
    }

    /// The members as a forest: the root first, then members whose
    /// first-seen parent is no member (reparented before first seen), each
    /// with its children in the order of their start. A member's parent is
    /// the member with its ppid that started no later than it (the newest
    /// such, where a pid was recycled). Linear in the members (plus a
    /// binary search per member among those sharing its parent's pid);
    /// nesting capped at [`MAX_DEPTH`].
    // Over 100 lines on purpose: one algorithm on index vectors local to it (members by start,
    // first-seen ppids, parents, children, the `leaf` closure over them): index, walk capped at
    // MAX_DEPTH, build bottom up; split, those vectors would be passed between the steps.
    pub fn hierarchy(&self) -> Vec<ProcessNode> {
        let mut execs: HashMap<Key, u32> = HashMap::new();
        // The ppid as first seen is the `member.observed` event's: the
        // member row's is rewritten when the member escapes.
        let mut first_ppid: HashMap<Key, i32> = HashMap::new();
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
                _ => {}
            }
        }
        let reach = self.forced_reach();
        let mut members: Vec<&MemberRow> = self.members.iter().collect();
        members.sort_by_key(|m| (m.start_ticks, m.pid));
        let n = members.len();
        let ppids: Vec<Option<i32>> = members
            .iter()
            .map(|m| first_ppid.get(&(m.pid, m.start_ticks)).copied().or(m.ppid))
            .collect();
        // pid -> the members with it, in the order they started.
        let mut by_pid: HashMap<i32, Vec<usize>> = HashMap::new();
        for (i, m) in members.iter().enumerate() {
            by_pid.entry(m.pid).or_default().push(i);
        }
        let parents: Vec<Option<usize>> = (0..n)
            .map(|i| {
                let m = members[i];
                let same = by_pid.get(&ppids[i]?)?;
                // The newest with that pid that started no later than it
                // (and is not itself).
                let upto = same.partition_point(|&p| members[p].start_ticks <= m.start_ticks);
                same[..upto].iter().rev().copied().find(|&p| p != i)
            })
            .collect();
        let mut children: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, p) in parents.iter().enumerate() {
            if let Some(p) = p {
                children[*p].push(i);
            }
        }
        let leaf = |i: usize| -> ProcessNode {
            let m = members[i];
            let key = (m.pid, m.start_ticks);
            let (force_killed, kill_authorized) = match reach.get(&key) {
                None => (false, false),
                Some(sent) => {
                    let exited_first = match (sent, m.exited_at.as_deref()) {
                        (Some(at), Some(gone)) => gone < *at,
                        _ => false,
                    };
                    let ended_otherwise = m.exit.is_some_and(|e| e.signal != Some(9));
                    let reached = sent.is_some() && !exited_first && !ended_otherwise;
                    (reached, !reached)
                }
            };
            ProcessNode {
                pid: m.pid,
                start_ticks: m.start_ticks,
                ppid: ppids[i],
                cmdline: m.cmdline.clone(),
                exe: m.exe.clone(),
                escaped: m.escaped_at.is_some(),
                execs: execs.get(&key).copied().unwrap_or(0),
                exited: m.exited_at.is_some(),
                exit: m.exit,
                force_killed,
                kill_authorized,
                flattened: 0,
                children: Vec::new(),
            }
        };
        let root = self.tree.root();
        let mut tops: Vec<usize> = (0..n).filter(|i| parents[*i].is_none()).collect();
        // The root first; the rest as they started.
        tops.sort_by_key(|i| {
            let m = members[*i];
            let is_root = root
                .as_ref()
                .is_some_and(|r| r.pid == m.pid && r.start_ticks == m.start_ticks);
            (!is_root, m.start_ticks, m.pid)
        });
        // Members no top reaches (a parent cycle, which only equal start
        // times allow) are tops too, after the rest.
        let mut visited = vec![false; n];
        let mut order: Vec<usize> = Vec::with_capacity(n);
        let mut flat: HashMap<usize, Vec<usize>> = HashMap::new();
        let mut forest_tops = Vec::new();
        let candidates: Vec<usize> = tops.into_iter().chain(0..n).collect();
        for top in candidates {
            if visited[top] {
                continue;
            }
            forest_tops.push(top);
            let mut stack = vec![(top, 0usize)];
            while let Some((i, depth)) = stack.pop() {
                if visited[i] {
                    continue;
                }
                visited[i] = true;
                order.push(i);
                if depth < MAX_DEPTH {
                    stack.extend(children[i].iter().rev().map(|&c| (c, depth + 1)));
                    continue;
                }
                // At the cap: every member below, flat, as they started.
                let mut below = Vec::new();
                let mut pending: Vec<usize> = children[i].iter().rev().copied().collect();
                while let Some(c) = pending.pop() {
                    if visited[c] {
                        continue;
                    }
                    visited[c] = true;
                    below.push(c);
                    pending.extend(children[c].iter().rev());
                }
                below.sort_by_key(|&c| (members[c].start_ticks, members[c].pid));
                flat.insert(i, below);
            }
        }
        // Bottom up: a node is built after everything below it.
        let mut built: Vec<Option<ProcessNode>> = (0..n).map(|_| None).collect();
        for &i in order.iter().rev() {
            let mut node = leaf(i);
            if let Some(below) = flat.remove(&i) {
                node.flattened = below.len();
                node.children = below.into_iter().map(leaf).collect();
            } else {
                node.children = children[i]
                    .iter()
                    .filter_map(|&c| built[c].take())
                    .collect();
            }
            built[i] = Some(node);
        }
        forest_tops
            .into_iter()
            .filter_map(|i| built[i].take())
            .collect()
    }
}

/// The forest as `pstree` draws it: one line per member, `├─`/`└─` under
/// its parent, `name(pid)` then its marks in brackets (iterative: the
/// forest's depth is the tree's to choose, up to [`MAX_DEPTH`]).
pub fn draw(forest: &[ProcessNode]) -> String {
    fn line(n: &ProcessNode) -> String {
        let marks = n.marks();
        let mut s = format!("{}({})", n.name(), n.pid);
        if !marks.is_empty() {
            s.push_str(&format!(" [{}]", marks.join(", ")));
        }
        s
    }
    fn push_children<'a>(
        stack: &mut Vec<(&'a ProcessNode, String, bool)>,
        n: &'a ProcessNode,
        prefix: &str,
    ) {
        let k = n.children.len();
        for (i, c) in n.children.iter().enumerate().rev() {
            stack.push((c, prefix.to_string(), i + 1 == k));
        }
    }
    let mut out = String::new();
    for top in forest {
        out.push_str(&line(top));
        out.push('\n');
        // (node, the prefix of its line, whether it is its parent's last)
        let mut stack: Vec<(&ProcessNode, String, bool)> = Vec::new();
        push_children(&mut stack, top, "");
        while let Some((n, prefix, last)) = stack.pop() {
            out.push_str(&prefix);
            out.push_str(if last { "└─" } else { "├─" });
            out.push_str(&line(n));
            out.push('\n');
            let deeper = format!("{prefix}{}", if last { "  " } else { "│ " });
            push_children(&mut stack, n, &deeper);
        }
    }
    out
}
