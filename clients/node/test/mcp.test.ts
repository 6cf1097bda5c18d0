/**
 * `TreewardenStdioClientTransport` with the real MCP TypeScript SDK (its
 * `Client`) and a real MCP server written with the SDK (mcp-server.ts),
 * started through an npx-style shim (mcp-shim.ts) that spawns it as a
 * child: the server is a grandchild of the tree's root. Which processes are
 * the server's is what the shim and the server wrote to their pid file,
 * never the product's word; each check polls with a bound.
 *
 * The SDK's own `StdioClientTransport` runs beside ours on the same
 * shapes, to show what ours changes: its close signals only the launcher
 * (typescript-sdk#2023), and a SIGKILLed host signals nothing.
 */

import assert from 'node:assert/strict';
import { spawn as spawnChild } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import * as path from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { after, before, describe, test } from 'node:test';

import { Client as McpClient } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import type { Transport } from '@modelcontextprotocol/sdk/shared/transport.js';

import { type SpawnOptions, outcomeOf } from '../src/index.js';
import { TreewardenStdioClientTransport } from '../src/mcp.js';
import { Server, alive, binary, waitUntil } from './server.js';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const BOUND = 10;

function params(pidfile: string, mark: string, linger: boolean) {
  return {
    command: process.execPath,
    args: [
      path.join(HERE, 'mcp-shim.js'), pidfile, '--',
      process.execPath, path.join(HERE, 'mcp-server.js'), pidfile, ...(linger ? ['--linger'] : []),
    ],
    env: { TW_NODE_MARK: mark },
  };
}

/** The shim's and the server's pids, as they wrote them. */
function pids(pidfile: string): Record<string, number> {
  const out: Record<string, number> = {};
  if (!existsSync(pidfile)) return out;
  for (const line of readFileSync(pidfile, 'utf8').split('\n')) {
    const [who, pid] = line.split(' ');
    if (who && pid) out[who] = Number(pid);
  }
  return out;
}

function live(pidfile: string): number[] {
  return Object.values(pids(pidfile)).filter(alive);
}

/** Ends what a plain transport left (by pid), so the test leaves nothing. */
async function end(pidfile: string): Promise<void> {
  for (const pid of live(pidfile)) {
    try {
      process.kill(pid, 'SIGKILL');
    } catch {
      // gone already
    }
  }
  assert.ok(await waitUntil(() => live(pidfile).length === 0, BOUND));
}

/** initialize, tools/list and two tool calls; the close is timed. */
async function round(transport: Transport) {
  const mcp = new McpClient({ name: 'treewarden-test', version: '1.0.0' });
  await mcp.connect(transport);
  const server = mcp.getServerVersion();
  const tools = (await mcp.listTools()).tools.map((t) => t.name).sort();
  const text = async (name: string, args: Record<string, unknown>) =>
    ((await mcp.callTool({ name, arguments: args })).content as { text: string }[])[0]!.text;
  const added = await text('add', { a: 2, b: 3 });
  const ids = await text('pids', {});
  const started = Date.now();
  await mcp.close();
  return { server, tools, added, ids, closeMs: Date.now() - started };
}

/** Whether this client streams stdio (spawn with `stdio: 'pipe'` gives streams). */
async function streamsStdio(s: Server): Promise<boolean> {
  const c = s.client();
  const t = c.spawn(['true'], { stdio: 'pipe' } as SpawnOptions);
  const has = t.stdin !== null;
  await t.outcome.catch(() => undefined);
  return has;
}

const noBinary = binary() ? false : 'skipped: no treewarden binary (cargo build, or set TREEWARDEN_BIN)';

describe('MCP stdio transport', { skip: noBinary }, () => {
  let s: Server;
  let streamed = false;
  before(async () => {
    s = await Server.start();
    streamed = await streamsStdio(s);
  });
  after(async () => {
    await s?.close();
  });
  const needs = (t: { skip(msg: string): void }): boolean => {
    if (!streamed) t.skip('skipped: needs streamed stdio');
    return streamed;
  };

  test('a session through a launcher: initialize, tools/list, a tool call; close in the spec order', async (t) => {
    if (!needs(t)) return;
    const pidfile = path.join(s.dir, 'polite');
    const transport = new TreewardenStdioClientTransport({ ...params(pidfile, s.mark, false), client: s.client(), label: `${s.mark}-polite` });
    const got = await round(transport);
    assert.equal(got.server?.name, 'treewarden-fixture');
    assert.deepEqual(got.tools, ['add', 'pids']);
    assert.equal(got.added, '5');
    const who = pids(pidfile);
    // The server is the shim's child: a grandchild of the tree's root.
    assert.equal(got.ids, `${who.server} ${who.shim}`);
    // Its stdin closed, the server exited by itself well inside the wait:
    // no signal was needed, and nothing is left.
    assert.ok(got.closeMs < 2000, `close took ${got.closeMs} ms`);
    t.diagnostic(`measured: polite close ${got.closeMs} ms`);
    assert.ok(await waitUntil(() => live(pidfile).length === 0, BOUND), `left: ${live(pidfile)}`);
    const o = await transport.outcome!;
    assert.deepEqual([o.reason, o.code, o.forced], ['exit', 0, false]);
  });

  test("typescript-sdk#2023's shape: the SDK's close leaves the launcher's child; ours ends the tree", async (t) => {
    if (!needs(t)) return;
    const plain = path.join(s.dir, 'plain');
    const p = await round(new StdioClientTransport(params(plain, s.mark, true)));
    assert.equal(p.added, '5');
    try {
      assert.ok(await waitUntil(() => !alive(pids(plain).shim!), BOUND), 'the SDK signals the launcher');
      assert.ok(alive(pids(plain).server!), "the SDK's close was to leave the lingering grandchild");
    } finally {
      await end(plain);
    }

    const ours = path.join(s.dir, 'ours');
    const transport = new TreewardenStdioClientTransport({
      ...params(ours, s.mark, true), client: s.client(), label: `${s.mark}-lingering`, exitWait: 500, grace: 1000,
    });
    const got = await round(transport);
    assert.equal(got.added, '5');
    t.diagnostic(`measured: lingering close (exitWait 500 ms) ${got.closeMs} ms`);
    // Closed stdin, 0.5 s, then the service's teardown of the whole tree.
    assert.deepEqual(live(ours), []);
    const o = await transport.outcome!;
    assert.equal(o.reason, 'killed');
    assert.equal(o.survivors, 0);
    assert.equal(outcomeOf(await s.client().detail(o.treeId)).reason, 'killed');
  });

  for (const which of ['treewarden', 'sdk'] as const) {
    test(`owner SIGKILLed (${which}): ${which === 'treewarden' ? 'no process of the server is left' : 'the server lives on'}`, async (t) => {
      if (!needs(t)) return;
      const pidfile = path.join(s.dir, `owner-${which}`);
      const owner = spawnChild(process.execPath, [path.join(HERE, 'mcp-owner.js'), which === 'sdk' ? 'plain' : s.socket, pidfile, s.mark], {
        stdio: ['ignore', 'pipe', 'inherit'],
      });
      try {
        const lines = createInterface({ input: owner.stdout! })[Symbol.asyncIterator]();
        assert.equal((await lines.next()).value, 'ready');
        assert.deepEqual(Object.keys(pids(pidfile)).sort(), ['server', 'shim']);
        const exited = new Promise((resolve) => owner.once('exit', resolve));
        owner.kill('SIGKILL');
        const killed = Date.now();
        await exited;
        const gone = await waitUntil(() => live(pidfile).length === 0, which === 'sdk' ? 3 : BOUND);
        if (which === 'treewarden') {
          assert.ok(gone, `left running: ${live(pidfile)}`);
          t.diagnostic(`measured: owner SIGKILLed -> nothing left in ${Date.now() - killed} ms`);
        }
        else assert.ok(!gone && alive(pids(pidfile).server!), 'the SDK had no chance to clean up');
      } finally {
        if (owner.exitCode === null && owner.signalCode === null) owner.kill('SIGKILL');
        await end(pidfile);
      }
    });
  }
});
