/**
 * Streamed stdio through the Node client against a real `serve`: stdin,
 * stdout and stderr as streams over the spawn's own connection, on the
 * Unix socket and on loopback TCP with a token; output written before the
 * upgrade is kept; back-pressure; a lost connection closes the tree's
 * stdin and nothing else. What runs is checked from /proc and files the
 * workload writes, never from the product's word.
 */

import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import * as path from 'node:path';
import type { Readable } from 'node:stream';
import { after, before, describe, test } from 'node:test';

import { Client } from '../src/index.js';
import { Server, alive, binary, waitUntil } from './server.js';

const skip = binary() ? false : 'skipped: no treewarden binary (cargo build, or set TREEWARDEN_BIN)';

function collect(r: Readable | null): Promise<string> {
  assert.ok(r);
  const chunks: Buffer[] = [];
  r.on('data', (c: Buffer) => chunks.push(c));
  return new Promise((resolve, reject) => {
    r.on('end', () => resolve(Buffer.concat(chunks).toString('utf8')));
    r.on('error', reject);
  });
}

/** A line-delimited JSON-RPC echo through `sh`: each request line answered with its id. */
const ECHO = `while IFS= read -r line; do printf '%s\\n' "$line"; done`;

async function roundTrips(c: Client, s: Server, n: number): Promise<void> {
  const t = c.spawn(['sh', '-c', `${ECHO} # ${s.mark}`], { env: s.env(), stdio: 'pipe' });
  assert.ok(t.stdin && t.stdout);
  let buf = '';
  const lines: string[] = [];
  let wake: (() => void) | undefined;
  t.stdout.on('data', (d: Buffer) => {
    buf += d.toString('utf8');
    let i: number;
    while ((i = buf.indexOf('\n')) >= 0) {
      lines.push(buf.slice(0, i));
      buf = buf.slice(i + 1);
    }
    wake?.();
  });
  for (let id = 1; id <= n; id++) {
    t.stdin.write(`${JSON.stringify({ jsonrpc: '2.0', id, method: 'ping' })}\n`);
    while (lines.length < id) await new Promise<void>((resolve) => (wake = resolve));
    assert.equal(JSON.parse(lines[id - 1] ?? '').id, id);
  }
  t.stdin.end();
  const o = await t.outcome;
  assert.equal(o.reason, 'exit');
  assert.equal(o.code, 0);
}

describe('streamed stdio', { skip }, () => {
  let s: Server;
  let c: Client;
  before(async () => {
    s = await Server.start();
    c = s.client();
  });
  after(async () => {
    await s?.close();
  });

  test('cat: what goes in stdin comes out of stdout, then exit and close with the outcome', async () => {
    const t = c.spawn(['cat'], { env: s.env(), stdio: 'pipe' });
    assert.ok(t.stdin);
    const out = collect(t.stdout);
    const events: string[] = [];
    t.on('exit', (code) => events.push(`exit ${code}`));
    const closed = new Promise<void>((resolve) => t.on('close', () => resolve()));
    t.stdin.write('hello ');
    t.stdin.end('world\n');
    assert.equal(await out, 'hello world\n');
    const o = await t.outcome;
    await closed;
    assert.equal(o.reason, 'exit');
    assert.equal(o.code, 0);
    assert.equal(typeof t.pid, 'number');
    assert.deepEqual(events, ['exit 0']);
  });

  test('stdout and stderr apart; what the tree writes before the upgrade is kept', async () => {
    const t = c.spawn(['sh', '-c', `echo early; echo oops >&2; exit 4 # ${s.mark}`], { env: s.env(), stdio: 'pipe' });
    const [out, err] = await Promise.all([collect(t.stdout), collect(t.stderr)]);
    assert.equal(out, 'early\n');
    assert.equal(err, 'oops\n');
    assert.equal((await t.outcome).code, 4);
  });

  test("['ignore', 'pipe', 'ignore']: stdin is closed at once, stderr dropped", async () => {
    const t = c.spawn(['sh', '-c', `cat; echo after-eof; echo x >&2 # ${s.mark}`], {
      env: s.env(),
      stdio: ['ignore', 'pipe', 'ignore'],
    });
    assert.equal(t.stdin, null);
    assert.equal(t.stderr, null);
    assert.equal(await collect(t.stdout), 'after-eof\n');
    assert.equal((await t.outcome).code, 0);
  });

  test('back-pressure: 8 MiB through a consumer that pauses arrive whole', async () => {
    const t = c.spawn(['head', '-c', String(8 << 20), '/dev/zero'], { env: s.env(), stdio: 'pipe' });
    assert.ok(t.stdout);
    let n = 0;
    let paused = 0;
    t.stdout.on('data', (d: Buffer) => {
      n += d.length;
      if (paused < 8 && n > paused * (1 << 20)) {
        paused += 1;
        t.stdout?.pause();
        setImmediate(() => t.stdout?.resume());
      }
    });
    await new Promise<void>((resolve) => t.stdout?.on('end', () => resolve()));
    assert.equal(n, 8 << 20);
    assert.equal((await t.outcome).code, 0);
  });

  test('a lost connection closes the tree stdin only: the tree lives on until killed', async () => {
    const flag = path.join(s.dir, 'stdin-closed');
    const t = c.spawn(['sh', '-c', `cat >/dev/null; touch ${flag}; echo $$; exec sleep 600 # ${s.mark}`], {
      env: s.env(),
      stdio: 'pipe',
      grace: '200ms',
    });
    await t.spawned;
    assert.ok(t.pid && alive(t.pid));
    t.disconnect();
    assert.ok(await waitUntil(() => existsSync(flag), 10), 'the tree never read its stdin end');
    const row = await c.tree(t.treeId ?? 0);
    assert.equal(row.state, 'running');
    assert.ok(alive(t.pid));
    const o = await t.terminate();
    assert.equal(o.reason, 'killed');
    assert.ok(await waitUntil(() => !alive(t.pid ?? 0), 10));
  });

  test('100 JSON-RPC round trips over the Unix socket', async () => {
    await roundTrips(c, s, 100);
  });

  test('100 JSON-RPC round trips over loopback TCP with a token', async () => {
    const tcp = new Client({ url: `http://${s.addr}`, token: s.token() });
    await roundTrips(tcp, s, 100);
  });

  test('a refused upgrade creates nothing', async () => {
    const label = `${s.mark}-refused`;
    const t = c.spawn([''], { env: s.env(), label, stdio: 'pipe' });
    t.on('error', () => undefined);
    await assert.rejects(t.spawned);
    assert.deepEqual(await c.trees({ label }), []);
  });
});
