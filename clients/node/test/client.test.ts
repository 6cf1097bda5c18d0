/**
 * The Node client against a real `serve`: spawn and exit, a kill that
 * takes the whole tree, AbortSignal, run()'s timeout, `await using`, 100
 * concurrent calls, 503 retries, 413, TCP with a token. What is gone is
 * checked from /proc with the pids the workload printed, never from the
 * product's word.
 */

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';

import { Client, PayloadTooLarge, Unauthorized, type Outcome } from '../src/index.js';
import { Server, alive, binary, marked, printedPids, waitUntil } from './server.js';

const skip = binary() ? false : 'skipped: no treewarden binary (cargo build, or set TREEWARDEN_BIN)';

describe('the client over the Unix socket', { skip }, () => {
  let s: Server;
  let c: Client;
  before(async () => {
    s = await Server.start();
    c = s.client();
  });
  after(async () => {
    await s?.close();
  });

  test('spawn: the spawn, exit and close events, and the exit code as a typed outcome', async () => {
    const t = c.spawn(['sh', '-c', `echo out; exit 3 # ${s.mark}`], { env: s.env(), label: 'exit3' });
    const events: string[] = [];
    t.on('spawn', () => events.push('spawn'));
    t.on('exit', (code, signal) => events.push(`exit ${code} ${signal}`));
    const closed = new Promise<Outcome>((resolve) => t.on('close', (_c, _s, o: Outcome) => resolve(o)));
    const id = await t.spawned;
    assert.equal(t.treeId, id);
    const o = await t.outcome;
    assert.deepEqual(await closed, o);
    assert.deepEqual(events, ['spawn', 'exit 3 null']);
    assert.equal(o.treeId, id);
    assert.equal(o.reason, 'exit');
    assert.equal(o.state, 'ended');
    assert.equal(o.code, 3);
    assert.equal(o.signal, null);
    assert.equal(o.forced, false);
    assert.equal(o.survivors, 0);
    assert.equal(t.exitCode, 3);
    assert.equal((await t.logs()).toString(), 'out\n');
    assert.equal(t.stdout, null);
  });

  test('kill tears down the whole tree: the grandchildren it printed are gone', async () => {
    // Each process ignores TERM and says its pid once its disposition is set.
    const t = c.spawn(
      ['sh', '-c', `trap '' TERM; sh -c 'trap "" TERM; sleep 600 & echo $$ $!; wait' & echo $$; wait # ${s.mark}`],
      { env: s.env(), grace: '300ms' },
    );
    const lines = await printedPids(() => t.logs(), 2);
    const pids = lines.flat();
    assert.equal(pids.length, 3, JSON.stringify(lines));
    assert.ok(pids.every(alive));
    assert.equal(t.kill(), true);
    const o = await t.outcome;
    assert.equal(o.reason, 'killed');
    assert.match(o.recorded ?? '', /^killed through the API/);
    assert.equal(o.forced, true);
    assert.equal(o.survivors, 0);
    assert.equal(o.state, 'ended');
    assert.ok(await waitUntil(() => !pids.some(alive), 10), `survivors: ${pids.filter(alive)}`);
    assert.equal(t.killed, true);
  });

  test('an already aborted signal creates nothing', async () => {
    const ac = new AbortController();
    ac.abort(new Error('not wanted'));
    const label = `${s.mark}-aborted`;
    const t = c.spawn(['sleep', '600'], { env: s.env(), label, signal: ac.signal });
    const errors: Error[] = [];
    t.on('error', (e) => errors.push(e));
    await assert.rejects(t.spawned, { name: 'AbortError' });
    await assert.rejects(t.outcome, { name: 'AbortError' });
    assert.equal(t.treeId, undefined);
    assert.deepEqual(await c.trees({ label }), []);
    assert.equal(errors.length, 1);
    assert.equal(errors[0]?.name, 'AbortError');
  });

  test('an abort tears the whole tree down and the outcome keeps its reason', async () => {
    const ac = new AbortController();
    const t = c.spawn(['sh', '-c', `sleep 600 & echo $$ $!; wait # ${s.mark}`], {
      env: s.env(),
      grace: '300ms',
      signal: ac.signal,
    });
    t.on('error', () => undefined);
    const pids = (await printedPids(() => t.logs(), 1)).flat();
    assert.equal(pids.length, 2);
    assert.equal(t.pid, pids[0], 'pid is the root process, as the workload says');
    ac.abort('the user pressed Esc');
    const o = await t.outcome;
    assert.equal(o.reason, 'killed');
    assert.equal(o.abortReason, 'the user pressed Esc');
    assert.equal(o.survivors, 0);
    assert.ok(await waitUntil(() => !pids.some(alive), 10), `survivors: ${pids.filter(alive)}`);
  });

  test('an abort while the spawn is in flight still ends the tree it made', async () => {
    const ac = new AbortController();
    const t = c.spawn(['sh', '-c', `sleep 600 & wait # ${s.mark}`], { env: s.env(), grace: '100ms', signal: ac.signal });
    t.on('error', () => undefined);
    ac.abort();
    const o = await t.outcome;
    assert.equal(typeof o.treeId, 'number');
    assert.equal(o.reason, 'killed');
    assert.equal(o.state, 'ended');
  });

  test('run() with a timeout: the outcome says timeout and nothing is left', async () => {
    const r = await c.run(['sh', '-c', `trap '' TERM; sleep 600 & echo $$ $!; wait # ${s.mark}`], {
      env: s.env(),
      timeout: 700,
      grace: 200,
    });
    assert.equal(r.reason, 'timeout');
    assert.match(r.recorded ?? '', /^timeout/);
    assert.equal(r.forced, true);
    assert.equal(r.survivors, 0);
    const pids = r.output.toString().trim().split(/\s+/).map(Number);
    assert.equal(pids.length, 2);
    assert.ok(await waitUntil(() => !pids.some(alive), 10));
    const ok = await c.run(['sh', '-c', 'echo fine'], { env: s.env(), timeout: '30s' });
    assert.equal(ok.reason, 'exit');
    assert.equal(ok.code, 0);
    assert.equal(ok.output.toString(), 'fine\n');
  });

  test('await using tears the tree down at the end of the scope', async () => {
    let pids: number[] = [];
    let id: number | undefined;
    {
      await using t = c.spawn(['sh', '-c', `sleep 600 & echo $$ $!; wait # ${s.mark}`], { env: s.env(), grace: '200ms' });
      pids = (await printedPids(() => t.logs(), 1)).flat();
      id = await t.spawned;
    }
    assert.ok(!pids.some(alive), `survivors: ${pids.filter(alive)}`);
    assert.equal((await c.tree(id))['state'], 'ended');
  });

  test('100 concurrent spawns are all answered (no EPIPE), and all end', async () => {
    const trees = Array.from({ length: 100 }, (_, i) =>
      c.spawn(['sh', '-c', `exit ${i % 7} # ${s.mark}`], { env: s.env(), label: `${s.mark}-many` }),
    );
    const outcomes = await Promise.all(trees.map((t) => t.outcome));
    assert.equal(outcomes.length, 100);
    outcomes.forEach((o, i) => {
      assert.equal(o.reason, 'exit');
      assert.equal(o.code, i % 7);
    });
    assert.equal(new Set(outcomes.map((o) => o.treeId)).size, 100);
    const health = await Promise.all(Array.from({ length: 100 }, () => c.health()));
    assert.ok(health.every((h) => typeof h.status === 'string'));
  });

  test('an argv over the body limit is a 413, reported as such', async () => {
    const t = c.spawn(['echo', 'x'.repeat(1_500_000)], { env: s.env() });
    t.on('error', () => undefined);
    await assert.rejects(t.spawned, (e: unknown) => {
      assert.ok(e instanceof PayloadTooLarge, String(e));
      assert.equal(e.status, 413);
      return true;
    });
  });

  test('TCP with a token; without one, Unauthorized', async () => {
    const tcp = new Client({ url: `http://${s.addr}`, token: s.token() });
    const o = await tcp.spawn(['sh', '-c', 'exit 7'], { env: s.env(), label: `${s.mark}-tcp` }).outcome;
    assert.equal(o.code, 7);
    assert.deepEqual(
      (await tcp.trees({ label: `${s.mark}-tcp` })).map((r) => r.id),
      [o.treeId],
    );
    const anon = new Client({ url: `http://${s.addr}` });
    const t = anon.spawn(['true'], { env: s.env() });
    t.on('error', () => undefined);
    await assert.rejects(t.spawned, Unauthorized);
  });

  test('unref: a script may exit while its tree runs, and the tree goes with it (its owner)', async () => {
    const index = new URL('../src/index.js', import.meta.url).href;
    const script = `
      import { Client } from '${index}';
      const t = new Client({ socketPath: process.argv[1] }).spawn(
        ['sh', '-c', 'sleep 600 & echo $$ $!; wait # ${s.mark}'], { env: { TW_NODE_MARK: '${s.mark}' }, grace: '200ms' });
      await t.spawned;
      t.unref();
      console.log(t.treeId);`;
    const { execFile } = await import('node:child_process');
    const out = await new Promise<string>((resolve, reject) =>
      execFile(process.execPath, ['--input-type=module', '-e', script, s.socket], { timeout: 30_000 }, (e, stdout) =>
        e ? reject(e) : resolve(stdout),
      ),
    );
    const id = Number(out.trim());
    assert.ok(id > 0, out);
    assert.ok(await waitUntil(async () => (await c.tree(id))['state'] === 'ended', 10));
    const o = (await import('../src/index.js')).outcomeOf(await c.detail(id));
    assert.equal(o.reason, 'owner-gone');
  });

  test('nothing carrying the mark is left', async () => {
    assert.ok(await waitUntil(() => marked(s.mark).length === 0, 10), `left: ${marked(s.mark)}`);
  });
});

describe('a service at its connection cap', { skip }, () => {
  let s: Server;
  before(async () => {
    s = await Server.start(['--max-connections-per-uid', '2']);
  });
  after(async () => {
    await s?.close();
  });

  test('503s are retried until every call is answered', async () => {
    const c = s.client({ maxConcurrent: 12, maxRetryDelayMs: 200, retries: 50 });
    const answers = await Promise.all(Array.from({ length: 40 }, () => c.health()));
    assert.equal(answers.length, 40);
    assert.ok(c.transport.retried > 0, 'the cap was never met');
    const o = await c.spawn(['true'], { env: s.env() }).outcome;
    assert.equal(o.code, 0);
  });
});
