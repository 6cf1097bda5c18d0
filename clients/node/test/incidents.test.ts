/**
 * The seeds' four incidents, as a harness would meet them, through the
 * Node client (as clients/python/tests/test_incidents.py does through the
 * Python one):
 *
 * 1. a hub SIGKILLs a member (the owner) after its SIGTERM, with three trees;
 * 2. sixteen stdin-holding ACP delegates of an owner that is SIGKILLed;
 * 3. a launcher that exits during the grace, leaving a TERM-ignoring child;
 * 4. a stdio MCP server whose owner crashes three times.
 *
 * Each asserts, from the workload's own word (the pids it printed, the
 * marker in its argv and environment, read from /proc), that nothing of
 * the trees survives within a bound, that the ledger's authorization names
 * exactly what was force-killed, committed before the SIGKILL, and that
 * the client's outcome says why (`owner-gone`, forced).
 */

import assert from 'node:assert/strict';
import { type ChildProcess, spawn as spawnChild } from 'node:child_process';
import * as path from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { after, before, describe, test } from 'node:test';

import { type Client, outcomeOf } from '../src/index.js';
import { Server, alive, binary, marked, printedPids, waitUntil } from './server.js';

const OWNER = path.join(path.dirname(fileURLToPath(import.meta.url)), 'owner.js');
/** Within this long (scaled) of the owner's death, nothing of its trees lives. */
const BOUND = 10;
const skip = binary() ? false : 'skipped: no treewarden binary (cargo build, or set TREEWARDEN_BIN)';

interface Started {
  tree: number;
  pids: number[];
  answer: string | null;
}

/** The owner process: started, read until `ready`, then killed. */
class Owner {
  readonly p: ChildProcess;
  readonly trees: Started[] = [];
  private readonly lines: AsyncIterator<string>;

  private constructor(s: Server, kind: string, count: number) {
    this.p = spawnChild(process.execPath, [OWNER, s.socket, s.mark, kind, String(count), s.dir], {
      stdio: ['ignore', 'pipe', 'inherit'],
      detached: true,
    });
    this.lines = createInterface({ input: this.p.stdout! })[Symbol.asyncIterator]();
  }

  static async start(s: Server, kind: string, count: number): Promise<Owner> {
    const o = new Owner(s, kind, count);
    for (;;) {
      const line = await o.next();
      if (line === 'ready') break;
      o.trees.push(JSON.parse(line) as Started);
    }
    assert.equal(o.trees.length, count, `the owner started ${o.trees.length} of ${count} trees`);
    return o;
  }

  async next(): Promise<string> {
    const r = await this.lines.next();
    assert.ok(!r.done, 'the owner ended early');
    return r.value.trim();
  }

  get pids(): number[] {
    return this.trees.flatMap((t) => t.pids);
  }

  /** SIGTERM, and its acknowledgement (the owner ignores it). */
  async term(): Promise<void> {
    this.p.kill('SIGTERM');
    assert.equal(await this.next(), 'term');
  }

  /** SIGKILL; the moment it was reaped. */
  async kill(): Promise<number> {
    const exited = new Promise<void>((resolve) => this.p.once('exit', () => resolve()));
    this.p.kill('SIGKILL');
    await exited;
    return Date.now();
  }
}

async function authorizedPids(c: Client, id: number): Promise<Set<number>> {
  const d = await c.detail(id);
  return new Set((d.authorizations ?? []).flatMap((a) => (a.targets ?? []).flatMap((t) => (t.identities ?? []).map((i) => i.pid))));
}

/** Nothing of the owner's trees lives within BOUND; each ended with the owner gone, forced, authorized. */
async function assertSettled(s: Server, c: Client, owner: Owner, since: number, what: string): Promise<void> {
  const pids = owner.pids;
  assert.equal(pids.length, 2 * owner.trees.length, JSON.stringify(owner.trees));
  const ok = await waitUntil(() => !pids.some(alive), BOUND);
  const took = Date.now() - since;
  assert.ok(ok, `${what}: survivors ${pids.filter(alive)} after ${BOUND}s`);
  for (const t of owner.trees) {
    assert.ok(await waitUntil(async () => (await c.tree(t.tree))['state'] === 'ended', BOUND), `${what}: tree ${t.tree}`);
    const d = await c.detail(t.tree);
    assert.equal((d.tree['owner'] as { pid: number }).pid, owner.p.pid);
    const o = outcomeOf(d);
    assert.equal(o.reason, 'owner-gone', `${what}: ${JSON.stringify(o)}`);
    assert.equal(o.forced, true);
    assert.equal(o.survivors, 0);
    const named = await authorizedPids(c, t.tree);
    for (const p of t.pids) assert.ok(named.has(p), `${what}: tree ${t.tree}: ${p} not in ${[...named]}`);
    const kills = (d.signals ?? []).filter((x) => x.signal === 'SIGKILL');
    assert.ok(kills.length > 0 && kills.every((k) => k.authorization !== null && k.authorization !== undefined), JSON.stringify(kills));
  }
  assert.ok(await waitUntil(() => marked(s.mark).length === 0, BOUND), `left: ${marked(s.mark)}`);
  console.log(`${what}: ${pids.length} processes of ${owner.trees.length} trees gone ${took} ms after the owner's death`);
}

describe('the seeds incidents through the Node client', { skip }, () => {
  let s: Server;
  let c: Client;
  before(async () => {
    s = await Server.start();
    c = s.client();
  });
  after(async () => {
    await s?.close();
  });

  test('1: a member SIGKILLed after its SIGTERM leaves nothing of its three trees', async () => {
    const owner = await Owner.start(s, 'tool', 3);
    assert.ok(owner.pids.every(alive));
    await owner.term();
    // The hub's SIGTERM ended nothing (the owner ignores it; its tools too).
    assert.ok(owner.pids.every(alive));
    const t = await owner.kill();
    await assertSettled(s, c, owner, t, 'incident 1');
  });

  test('2: sixteen stdin-holding delegates of a SIGKILLed owner are all ended', async () => {
    const owner = await Owner.start(s, 'acp', 16);
    assert.equal(new Set(owner.pids).size, 32);
    const t = await owner.kill();
    await assertSettled(s, c, owner, t, 'incident 2');
  });

  test('3: a launcher that exits during the grace leaves no TERM-ignoring child', async () => {
    // The launcher exits at SIGTERM (during the grace); its child ignores
    // it. Each says its pid once its disposition is set.
    const t = c.spawn(
      ['sh', '-c', `sh -c 'trap "" TERM; echo child $$; exec sleep 600' & trap 'exit 0' TERM; echo launcher $$; wait # ${s.mark}`],
      { env: s.env(), grace: '1s', label: `${s.mark}-launcher` },
    );
    await printedPids(() => t.logs(), 2);
    const said = Object.fromEntries(
      (await t.logs()).toString().trim().split('\n').map((l) => l.split(' ') as [string, string]),
    );
    const launcher = Number(said.launcher);
    const child = Number(said.child);
    const o = await t.terminate();
    assert.equal(o.state, 'ended');
    assert.equal(o.reason, 'killed');
    assert.equal(o.forced, true);
    assert.ok(!alive(launcher) && !alive(child));
    // The launcher's own exit (status 0, at its SIGTERM) is recorded, and
    // the authorization names the child it left, not the launcher.
    assert.equal(o.code, 0);
    const named = await authorizedPids(c, o.treeId);
    assert.ok(named.has(child) && !named.has(launcher), [...named].join(' '));
    assert.deepEqual(marked(s.mark), []);
  });

  test('4: a stdio server whose owner crashes three times never piles up', async () => {
    const seen = new Set<number>();
    for (let crash = 1; crash <= 3; crash++) {
      const owner = await Owner.start(s, 'mcp', 1);
      assert.equal(owner.trees[0]?.answer, 're: ping');
      assert.ok(owner.pids.every((p) => !seen.has(p)));
      // Before the crash only this server lives: nothing of the earlier ones.
      assert.ok(marked(s.mark).length > 0 && ![...seen].some(alive));
      owner.pids.forEach((p) => seen.add(p));
      const t = await owner.kill();
      await assertSettled(s, c, owner, t, `incident 4, crash ${crash}`);
      assert.deepEqual(marked(s.mark), []);
    }
  });
});
