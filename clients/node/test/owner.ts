/**
 * An owner as the seeds' harnesses are: a process that starts trees
 * through the client and is then killed. Run by incidents.test.ts.
 *
 *     node owner.js SOCKET MARK KIND COUNT DIR
 *
 * It spawns COUNT trees of KIND, prints one JSON line per tree with the
 * pids the *workload* printed (read from its captured log, never the
 * product's word), then `ready`, and waits. On SIGTERM it prints `term`
 * and goes on waiting (a hub member that does not clean up), so only its
 * SIGKILL ends it.
 *
 * The API has no streamed stdio yet, so a workload's stdin is a FIFO in
 * DIR that this process holds open (read-write: the open never blocks),
 * as a harness holds a stdio server's stdin; its answers are in its log.
 */

import { execFileSync } from 'node:child_process';
import { openSync, writeSync } from 'node:fs';
import * as path from 'node:path';

import { Client } from '../src/index.js';
import { printedPids, waitUntil } from './server.js';

// Each workload prints its own pids on its first line and ignores SIGTERM,
// so only a forced kill, with its authorization, ends it.
const WORKLOADS: Record<string, string> = {
  // A hub member's tool: a shell with a child that outlives it.
  tool: "trap '' TERM; sleep 600 & echo $$ $!; wait",
  // An ACP delegate: it holds its stdin and keeps a child running.
  acp: "trap '' TERM HUP; sleep 600 & echo $$ $!; cat >/dev/null; wait",
  // A stdio MCP server: it answers requests and keeps its child.
  mcp: "trap '' TERM HUP PIPE; sleep 600 & echo $$ $!; while read line; do echo \"re: $line\"; done; wait",
};

async function main(): Promise<void> {
  const [sock, mark, kind, countText, dir] = process.argv.slice(2) as [string, string, string, string, string];
  const count = Number(countText);
  process.on('SIGTERM', () => process.stdout.write('term\n'));
  const client = new Client({ socketPath: sock });
  const fifos: number[] = [];
  const trees = [];
  for (let i = 0; i < count; i++) {
    const fifo = path.join(dir, `${kind}-${process.pid}-${i}.in`);
    execFileSync('mkfifo', [fifo]);
    fifos.push(openSync(fifo, 'r+'));
    const t = client.spawn(['sh', '-c', `exec 0<'${fifo}'; ${WORKLOADS[kind]} # ${mark}`], {
      label: `${mark}-${kind}`,
      env: { TW_NODE_MARK: mark },
      grace: '300ms',
    });
    trees.push(t);
  }
  for (const [i, t] of trees.entries()) {
    const id = await t.spawned;
    const pids = (await printedPids(() => t.logs(), 1)).flat();
    let answer: string | null = null;
    if (kind === 'mcp') {
      writeSync(fifos[i]!, 'ping\n');
      await waitUntil(async () => (await t.logs()).toString().includes('re: ping'), 20, 20);
      answer = (await t.logs()).toString().split('\n').find((l) => l.startsWith('re: ')) ?? null;
    }
    process.stdout.write(`${JSON.stringify({ tree: id, pids, answer })}\n`);
  }
  process.stdout.write('ready\n');
  // Held until killed: the event loop stays alive on this timer.
  setInterval(() => undefined, 1 << 30);
}

main().catch((e) => {
  process.stderr.write(`owner: ${e?.stack ?? e}\n`);
  process.exit(1);
});
