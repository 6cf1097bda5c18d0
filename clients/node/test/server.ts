/**
 * A real `treewarden serve` on a Unix socket in a temp dir (and loopback
 * TCP on a free port), for each test that asks for one.
 *
 * The binary is `TREEWARDEN_BIN` or the repository's
 * `target/debug/treewarden` (`cargo build`); without it every test is
 * skipped, and says so. Every tree a test starts carries the server's
 * marker in its environment and argv, so what survives is found from
 * `/proc` (not from the product's word) and ended by pid at the end.
 */

import { type ChildProcess, spawn as spawnChild } from 'node:child_process';
import { existsSync, mkdtempSync, openSync, readFileSync, readdirSync, rmSync, closeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';
import { setTimeout as sleep } from 'node:timers/promises';

import { Client, type ClientOptions } from '../src/index.js';

const HERE = path.dirname(fileURLToPath(import.meta.url));
/** clients/node/dist/test -> the repository. */
export const REPO = path.resolve(HERE, '..', '..', '..', '..');

let seq = 0;

/** Poll bounds are scaled by TREEWARDEN_TEST_POLL_SCALE (slow hosts). */
export function scale(): number {
  const v = Number(process.env.TREEWARDEN_TEST_POLL_SCALE ?? '1');
  return Number.isFinite(v) && v > 1 ? v : 1;
}

/** Polls `cond` until it holds or `limitS` (scaled) seconds pass. */
export async function waitUntil(cond: () => boolean | Promise<boolean>, limitS: number, stepMs = 10): Promise<boolean> {
  const deadline = Date.now() + limitS * 1000 * scale();
  for (;;) {
    if (await cond()) return true;
    if (Date.now() >= deadline) return false;
    await sleep(stepMs); // the poll interval of waitUntil, not a wait for a condition
  }
}

export function binary(): string | undefined {
  const b = process.env.TREEWARDEN_BIN || path.join(REPO, 'target', 'debug', 'treewarden');
  return existsSync(b) ? b : undefined;
}

/** Exists and is not a zombie (by /proc, not by the product). */
export function alive(pid: number): boolean {
  let stat: string;
  try {
    stat = readFileSync(`/proc/${pid}/stat`, 'latin1');
  } catch {
    return false;
  }
  const st = stat.slice(stat.lastIndexOf(')') + 2, stat.lastIndexOf(')') + 3);
  return st !== 'Z' && st !== 'X';
}

/** Live processes whose environment or argv carries `mark`. */
export function marked(mark: string): number[] {
  const out: number[] = [];
  for (const d of readdirSync('/proc')) {
    if (!/^\d+$/.test(d)) continue;
    const pid = Number(d);
    if (pid === process.pid) continue;
    let hit = false;
    for (const what of ['environ', 'cmdline']) {
      try {
        if (readFileSync(`/proc/${pid}/${what}`).includes(mark)) {
          hit = true;
          break;
        }
      } catch {
        // gone, or not ours to read
      }
    }
    if (hit && alive(pid)) out.push(pid);
  }
  return out;
}

/** One `treewarden serve` with its own data dir, socket and TCP port. */
export class Server {
  readonly dir: string;
  readonly data: string;
  readonly socket: string;
  readonly mark: string;
  proc: ChildProcess | undefined;
  /** `127.0.0.1:PORT` */
  addr = '';

  private constructor(readonly bin: string, readonly extra: string[]) {
    this.dir = mkdtempSync(path.join(tmpdir(), 'tw-node-'));
    this.data = path.join(this.dir, 'data');
    this.socket = path.join(this.dir, 'api.sock');
    this.mark = `tw-nodetest-${process.pid}-${seq++}`;
  }

  static async start(extra: string[] = []): Promise<Server> {
    const bin = binary();
    if (!bin) throw new Error('no treewarden binary');
    const s = new Server(bin, extra);
    const ready = path.join(s.dir, 'ready');
    const err = openSync(path.join(s.dir, 'serve.stderr'), 'w');
    const env: NodeJS.ProcessEnv = { ...process.env, TREEWARDEN_DATA_DIR: s.data, TREEWARDEN_LOG: 'info', TREEWARDEN_BOUNDARY: 'session' };
    delete env.OTEL_EXPORTER_OTLP_ENDPOINT;
    delete env.TREEWARDEN_CGROUP_ROOT;
    s.proc = spawnChild(
      bin,
      ['serve', '--listen', '127.0.0.1:0', '--socket', s.socket, '--ready-file', ready, '--scan-interval', '100ms', ...extra],
      { cwd: s.dir, env, stdio: ['ignore', 'ignore', err], detached: true },
    );
    closeSync(err);
    if (!(await waitUntil(() => existsSync(ready), 30))) {
      await s.close();
      throw new Error(`serve did not come up: ${s.log()}`);
    }
    s.addr = readFileSync(ready, 'utf8').trim();
    return s;
  }

  log(): string {
    try {
      return readFileSync(path.join(this.dir, 'serve.stderr'), 'utf8');
    } catch {
      return '';
    }
  }

  token(): string {
    return readFileSync(path.join(this.data, 'api-token'), 'utf8').trim();
  }

  client(opts: ClientOptions = {}): Client {
    return new Client({ socketPath: this.socket, ...opts });
  }

  /** The environment that marks a tree as this server's test's. */
  env(): Record<string, string> {
    return { TW_NODE_MARK: this.mark };
  }

  /** Stops the service (SIGTERM by its pid), ends what carries the mark (by pid), removes the dir. */
  async close(): Promise<void> {
    const p = this.proc;
    if (p && p.exitCode === null && p.signalCode === null && p.pid) {
      const exited = new Promise<void>((resolve) => p.once('exit', () => resolve()));
      p.kill('SIGTERM');
      const done = await Promise.race([exited.then(() => true), sleep(40_000 * scale(), undefined, { ref: false }).then(() => false)]);
      if (!done) {
        p.kill('SIGKILL');
        await exited;
      }
    }
    this.proc = undefined;
    for (const pid of marked(this.mark)) {
      try {
        process.kill(pid, 'SIGKILL');
      } catch {
        // gone already
      }
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}

/** The pids a workload printed on the first `n` lines of its captured log. */
export async function printedPids(logs: () => Promise<Buffer>, n: number, limitS = 20): Promise<number[][]> {
  let lines: string[] = [];
  const ok = await waitUntil(async () => {
    lines = (await logs()).toString('utf8').split('\n').filter((l) => l.trim() !== '');
    return lines.length >= n;
  }, limitS, 20);
  if (!ok) throw new Error(`the workload printed ${lines.length} of ${n} lines: ${JSON.stringify(lines)}`);
  return lines.slice(0, n).map((l) => l.trim().split(/\s+/).filter((w) => /^\d+$/.test(w)).map(Number));
}
