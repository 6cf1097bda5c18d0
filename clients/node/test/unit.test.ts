/**
 * The client's own decisions, without a service: how an outcome is read
 * from a tree's record, which error an answer is, and which 503s are
 * retried (against a stand-in HTTP server on a Unix socket).
 */

import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import * as http from 'node:http';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { describe, test } from 'node:test';

import {
  Client,
  DispatchClosed,
  PayloadTooLarge,
  ServiceError,
  TreewardenError,
  Unavailable,
  defaultSocket,
  duration,
  fromBody,
  outcomeOf,
  ownIdentity,
} from '../src/index.js';

function record(state: string, reason: string | null, extra: Record<string, unknown> = {}) {
  const events = reason === null ? [] : [{ kind: 'tree.state', data: { from: 'running', to: 'terminating', reason } }];
  return { tree: { id: 7, state, exit: { code: null, signal: 15 } }, events, signals: [], ...extra };
}

describe('the outcome, read from the record', () => {
  test('each recorded reason has its typed reason', () => {
    const cases: Array<[string, string | null, string]> = [
      ['ended', null, 'exit'],
      ['ended', 'root exited (exited with code 0)', 'exit'],
      ['ended', 'timeout after 1s', 'timeout'],
      ['ended', 'owner exited', 'owner-gone'],
      ['ended', 'killed through the API by uid 0 (pid 1) over the socket', 'killed'],
      ['ended', 'service shutting down', 'killed'],
      ['ambiguous', 'timeout after 1s', 'unkillable'],
    ];
    for (const [state, reason, want] of cases) {
      const o = outcomeOf(record(state, reason));
      assert.equal(o.reason, want, `${state} ${reason}`);
      assert.equal(o.recorded, reason);
      assert.equal(o.signal, 'SIGTERM');
      assert.equal(o.code, null);
      assert.equal(o.treeId, 7);
    }
  });

  test('forced is a SIGKILL in the record; survivors are what the last authorization named', () => {
    const o = outcomeOf(
      record('ambiguous', 'owner exited', {
        signals: [{ signal: 'SIGTERM' }, { signal: 'SIGKILL', authorization: 1 }],
        authorizations: [{ targets: [{ identities: [{ pid: 10 }, { pid: 11 }] }] }],
      }),
    );
    assert.equal(o.forced, true);
    assert.equal(o.survivors, 2);
    assert.equal(outcomeOf(record('ended', 'owner exited')).survivors, 0);
  });

  test('durations are milliseconds or the CLI strings', () => {
    assert.equal(duration(1500), '1500ms');
    assert.equal(duration(2000), '2s');
    assert.equal(duration('300ms'), '300ms');
    assert.throws(() => duration(-1), RangeError);
  });
});

describe('the owner and the socket', () => {
  test('the owner is this process: its pid, and its start time as /proc has it', { skip: !existsSync('/proc/self/stat') }, () => {
    const me = ownIdentity();
    assert.equal(me.pid, process.pid);
    const stat = readFileSync(`/proc/${process.pid}/stat`, 'latin1');
    assert.equal(me.startTicks, Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[19]));
  });

  test('the socket: TREEWARDEN_SOCKET, else api.sock in TREEWARDEN_DATA_DIR', { skip: existsSync('/run/treewarden/api.sock') }, () => {
    const saved = { ...process.env };
    try {
      process.env.TREEWARDEN_SOCKET = '/tmp/x.sock';
      assert.equal(defaultSocket(), '/tmp/x.sock');
      delete process.env.TREEWARDEN_SOCKET;
      process.env.TREEWARDEN_DATA_DIR = '/tmp/tw-data';
      assert.equal(defaultSocket(), '/tmp/tw-data/api.sock');
    } finally {
      process.env = saved;
    }
  });
});

describe('errors by code', () => {
  test('the code decides, a 413 is PayloadTooLarge, a bare 503 is Unavailable', () => {
    assert.ok(fromBody(503, { error: 'x', code: 'DispatchClosed', tree: 3 }) instanceof DispatchClosed);
    assert.equal(fromBody(503, { error: 'x', code: 'DispatchClosed', tree: 3 }).tree, 3);
    assert.ok(fromBody(503, 'Service Unavailable') instanceof Unavailable);
    assert.ok(fromBody(413, { error: 'too big', code: 'BadRequest' }) instanceof PayloadTooLarge);
    assert.ok(fromBody(500, { error: 'x', code: 'Internal' }) instanceof ServiceError);
    const other = fromBody(502, 'Bad Gateway');
    assert.equal(other.constructor, TreewardenError);
    assert.equal(other.message, 'Bad Gateway');
  });
});

/** A stand-in service answering each request from `answers` in turn. */
async function standIn(answers: Array<[number, unknown]>): Promise<{ socket: string; seen: () => number; close: () => Promise<void> }> {
  const dir = mkdtempSync(path.join(tmpdir(), 'tw-node-unit-'));
  const socket = path.join(dir, 'api.sock');
  let n = 0;
  const server = http.createServer((req, res) => {
    req.resume();
    const [status, body] = answers[Math.min(n, answers.length - 1)]!;
    n += 1;
    res.writeHead(status, { 'Content-Type': 'application/json', 'Retry-After': '1', Connection: 'close' });
    res.end(JSON.stringify(body));
  });
  await new Promise<void>((resolve) => server.listen(socket, resolve));
  return {
    socket,
    seen: () => n,
    close: async () => {
      await new Promise<void>((resolve) => server.close(() => resolve()));
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

describe('503s', () => {
  test('Unavailable is retried until answered', async () => {
    const busy = { error: 'busy', code: 'Unavailable' };
    const s = await standIn([[503, busy], [503, busy], [200, { status: 'ok' }]]);
    try {
      const c = new Client({ socketPath: s.socket, maxRetryDelayMs: 20 });
      assert.deepEqual(await c.health(), { status: 'ok' });
      assert.equal(s.seen(), 3);
      assert.equal(c.transport.retried, 2);
    } finally {
      await s.close();
    }
  });

  test('DispatchClosed is never retried', async () => {
    const s = await standIn([[503, { error: 'unsettled', code: 'DispatchClosed', tree: 4 }]]);
    try {
      const c = new Client({ socketPath: s.socket, maxRetryDelayMs: 20 });
      await assert.rejects(c.health(), (e: unknown) => e instanceof DispatchClosed && e.tree === 4);
      assert.equal(s.seen(), 1);
    } finally {
      await s.close();
    }
  });

  test('retries are bounded', async () => {
    const s = await standIn([[503, { error: 'busy', code: 'Unavailable' }]]);
    try {
      const c = new Client({ socketPath: s.socket, maxRetryDelayMs: 5, retries: 3 });
      await assert.rejects(c.health(), Unavailable);
      assert.equal(s.seen(), 4);
    } finally {
      await s.close();
    }
  });
});
