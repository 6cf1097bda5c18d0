/**
 * `Client`: the service's API as Node code wants it, shaped like
 * `child_process`. `spawn()` answers a `TreeProcess` at once (an
 * `EventEmitter`: `'spawn'`, `'exit'`, `'close'`, `'error'`); `run()` is
 * `execFile` with a timeout; every end is a typed `Outcome`.
 *
 * The owner of every tree is this process (its pid, and on Linux its start
 * time from `/proc/self/stat`): the service tears the tree down within a
 * second of its exit, whatever the caller forgot.
 *
 * stdio: by default a tree's stdin is `/dev/null` and its stdout and
 * stderr go to the service's captured log (`logs()`); `stdin`, `stdout`
 * and `stderr` are `null`. With `stdio: 'pipe'` (or `['pipe', 'pipe',
 * 'ignore']`, ...) they are streams carried by the spawn's own connection
 * (streamed stdio, `./stdio.ts`), over the Unix socket or TCP alike.
 */

import { EventEmitter } from 'node:events';
import type { Readable, Writable } from 'node:stream';
import { existsSync, readFileSync } from 'node:fs';
import { constants as osConstants, homedir } from 'node:os';
import * as path from 'node:path';

import { Ambiguous, Conflict, NotFound, TreewardenError } from './errors.js';
import { type Endpoint, Transport, type TransportOptions, query } from './http.js';
import { PROTOCOL, type StdioOption, StdioStreams, stdioSlots } from './stdio.js';

/** Milliseconds (as Node's timeouts), or the CLI's strings (`'300ms'`, `'2s'`). */
export type Duration = number | string;

/** Why a tree ended. */
export type EndReason =
  /** its root exited (what it left running was torn down with it) */
  | 'exit'
  /** its `timeout` passed */
  | 'timeout'
  /** a kill: `kill()`, an abort, `await using`, another client, the service's shutdown */
  | 'killed'
  /** its owner (this process) died */
  | 'owner-gone'
  /** the teardown could not prove its authority: survivors left alive as evidence */
  | 'unkillable';

/** How a tree ended: never a bare boolean. */
export interface Outcome {
  treeId: number;
  reason: EndReason;
  /** The ledger's state: `ended`, `ambiguous`, `vanished`, `spawn_failed`, `resolved`. */
  state: string;
  /** The root's exit code, when it exited. */
  code: number | null;
  /** The signal that ended the root, when one did. */
  signal: NodeJS.Signals | null;
  /** Whether the teardown had to SIGKILL (under a committed authorization). */
  forced: boolean;
  /** Processes left alive (only an `unkillable` end leaves any). */
  survivors: number;
  /** The reason the service recorded for the teardown (`'timeout after 1s'`, …). */
  recorded: string | null;
  /** Set when an `AbortSignal` ended the tree: the signal's reason. */
  abortReason?: unknown;
}

export interface SpawnOptions {
  label?: string;
  /** Between the first signal and SIGKILL (the service's default: 5s). */
  grace?: Duration;
  /** The whole tree is torn down this long after its spawn. */
  timeout?: Duration;
  env?: Record<string, string>;
  cwd?: string;
  limits?: { memory_max?: string; pids_max?: number; cpu_max?: string };
  /** `'root'` (default): the tree ends with its root; `'owner'`: with its owner. */
  lifetime?: 'root' | 'owner';
  /** The teardown's first signal: `'TERM'` (default), `'INT'`, … */
  firstSignal?: string;
  /** Aborted before the spawn: nothing is created. Aborted after: the tree is torn down. */
  signal?: AbortSignal;
  /**
   * As `child_process`: `'pipe'` gives `stdin`/`stdout`/`stderr` streams
   * over the spawn's connection (a lost connection closes the tree's stdin
   * and nothing else); `'inherit'` copies to this process's; `'ignore'`
   * drops. Left out (or all `'ignore'`): stdin is `/dev/null`, the output
   * goes to the captured log (`logs()`).
   */
  stdio?: StdioOption;
}

export interface RunResult extends Outcome {
  /** The captured stdout and stderr (the service's log of the tree). */
  output: Buffer;
}

/** States after which a tree does not change by itself. */
const FINAL = new Set(['ended', 'vanished', 'spawn_failed', 'resolved']);
/** `wait` answers at these too. */
const SETTLED = new Set([...FINAL, 'ambiguous']);

/** A Duration as the API takes it. */
export function duration(d: Duration): string {
  if (typeof d === 'string') return d;
  if (!Number.isFinite(d) || d < 0) throw new RangeError(`a duration is milliseconds >= 0, not ${d}`);
  const ms = Math.round(d);
  return ms % 1000 === 0 ? `${ms / 1000}s` : `${ms}ms`;
}

function durationMs(d: Duration | undefined): number {
  if (d === undefined) return 0;
  if (typeof d === 'number') return d;
  const m = /^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$/.exec(d);
  if (!m) return 0;
  const f = { ms: 1, s: 1000, m: 60_000, h: 3_600_000 }[(m[2] ?? 's') as 'ms' | 's' | 'm' | 'h'];
  return Number(m[1]) * f;
}

/** This process's pid, and its start time in clock ticks where `/proc` has it. */
export function ownIdentity(): { pid: number; startTicks?: number } {
  try {
    const stat = readFileSync('/proc/self/stat', 'latin1');
    // The fields after the command name, which may hold spaces and ')'.
    const rest = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return { pid: process.pid, startTicks: Number(rest[19]) };
  } catch {
    return { pid: process.pid };
  }
}

/** Where the service's socket is, as the CLI would find it. */
export function defaultSocket(): string {
  const env = process.env.TREEWARDEN_SOCKET;
  if (env) return env;
  const unit = '/run/treewarden/api.sock';
  if (existsSync(unit)) return unit;
  let data = process.env.TREEWARDEN_DATA_DIR;
  if (!data) {
    if (process.getuid?.() === 0) data = '/var/lib/treewarden';
    else data = path.join(process.env.XDG_STATE_HOME || path.join(homedir(), '.local', 'state'), 'treewarden');
  }
  return path.join(data, 'api.sock');
}

const SIGNAL_NAMES = new Map<number, NodeJS.Signals>(
  Object.entries(osConstants.signals).map(([name, n]) => [n as number, name as NodeJS.Signals]),
);

type Row = Record<string, unknown> & { id: number; state: string; exit?: { code?: number | null; signal?: number | null } | null };
interface Detail {
  tree: Row;
  signals?: Array<{ signal: string; authorization?: number | null }>;
  members?: Array<Record<string, unknown>>;
  authorizations?: Array<{ targets?: Array<{ identities?: Array<{ pid: number }> }> }>;
  events?: Array<{ kind: string; data?: Record<string, unknown> }>;
}

function classify(recorded: string | null, state: string): EndReason {
  if (state === 'ambiguous') return 'unkillable';
  if (recorded === null || recorded.startsWith('root exited')) return 'exit';
  if (recorded.startsWith('timeout')) return 'timeout';
  if (recorded.startsWith('owner exited') || recorded.includes('parent died')) return 'owner-gone';
  return 'killed';
}

/** The outcome of a settled tree, from its whole record. */
export function outcomeOf(d: Detail): Outcome {
  const row = d.tree;
  // The first teardown's reason (a resumed teardown keeps the first one's).
  let recorded: string | null = null;
  for (const e of d.events ?? []) {
    const r = e.data?.reason;
    if (e.data?.to === 'terminating' && typeof r === 'string') {
      recorded = r;
      break;
    }
  }
  const exit = row.exit ?? {};
  const forced = (d.signals ?? []).some((s) => s.signal === 'SIGKILL');
  let survivors = 0;
  if (row.state === 'ambiguous') {
    const last = (d.authorizations ?? []).at(-1);
    survivors = (last?.targets ?? []).reduce((n, t) => n + (t.identities?.length ?? 0), 0) || 1;
  }
  return {
    treeId: row.id,
    reason: classify(recorded, row.state),
    state: row.state,
    code: typeof exit.code === 'number' ? exit.code : null,
    signal: typeof exit.signal === 'number' ? (SIGNAL_NAMES.get(exit.signal) ?? null) : null,
    forced,
    survivors,
    recorded,
  };
}

function abortError(signal: AbortSignal): Error {
  const e = new Error('The operation was aborted', { cause: signal.reason });
  e.name = 'AbortError';
  (e as NodeJS.ErrnoException).code = 'ABORT_ERR';
  return e;
}

/** Swallows a rejection nobody awaited (it is still there for those who do). */
function quiet<T>(p: Promise<T>): Promise<T> {
  p.catch(() => undefined);
  return p;
}

/**
 * One tree in custody, as `ChildProcess` is one process. Events:
 * `'spawn'` (the tree is recorded; `treeId` is set), `'exit'` (code,
 * signal) and then `'close'` (code, signal, outcome) once the tree has
 * ended, `'error'` when the spawn failed or was aborted (emitted only to a
 * listener; `spawned` and `outcome` reject with it too).
 */
export class TreeProcess extends EventEmitter {
  readonly spawnargs: string[];
  /** The tree's id, once recorded. */
  treeId: number | undefined;
  /** The root's pid, once recorded. */
  pid: number | undefined;
  exitCode: number | null = null;
  signalCode: NodeJS.Signals | null = null;
  /** Whether a teardown was asked for through this object. */
  killed = false;
  /** The tree's stdin, with `stdio: 'pipe'`; `end()` closes it (the tree reads EOF). */
  readonly stdin: Writable | null = null;
  /** The tree's stdout, with `stdio: 'pipe'` (else `null`: see `logs()`). */
  readonly stdout: Readable | null = null;
  /** The tree's stderr, with `stdio: 'pipe'`. */
  readonly stderr: Readable | null = null;
  /** The streamed stdio's connection, when stdio is streamed. */
  private readonly streams: StdioStreams | undefined;
  /** The tree's id once it is recorded; rejects when it was not. */
  readonly spawned: Promise<number>;
  /** How the tree ended; rejects when it was never created. */
  readonly outcome: Promise<Outcome>;
  private settledOutcome: Outcome | undefined;
  private abortReason: unknown;
  private aborted = false;
  private kills: Promise<void> | undefined;
  private readonly grace: Duration | undefined;
  private refed = true;
  private waitSocket: import('node:net').Socket | undefined;

  constructor(
    private readonly client: Client,
    argv: readonly string[],
    opts: SpawnOptions,
  ) {
    super();
    this.spawnargs = [...argv];
    this.grace = opts.grace;
    const slots = stdioSlots(opts.stdio);
    if (slots) {
      this.streams = new StdioStreams(slots);
      this.stdin = this.streams.stdin;
      this.stdout = this.streams.stdout;
      this.stderr = this.streams.stderr;
    }
    const signal = opts.signal;
    this.spawned = quiet(this.start(argv, opts));
    this.outcome = quiet(this.follow());
    if (signal && !signal.aborted) {
      const onAbort = (): void => {
        this.aborted = true;
        this.abortReason = signal.reason;
        if (this.listenerCount('error') > 0) this.emit('error', abortError(signal));
        void this.spawned.then(() => this.teardown(), () => undefined);
      };
      signal.addEventListener('abort', onAbort, { once: true });
      void this.outcome.finally(() => signal.removeEventListener('abort', onAbort)).catch(() => undefined);
    }
  }

  private async start(argv: readonly string[], opts: SpawnOptions): Promise<number> {
    try {
      if (opts.signal?.aborted) throw abortError(opts.signal);
      if (this.streams) {
        const up = await this.client.transport.upgrade('POST', '/api/trees', PROTOCOL, {
          body: { ...spawnBody(argv, opts), stdio: 'stream' },
        });
        this.treeId = Number(up.headers['treewarden-tree']);
        const root = Number(up.headers['treewarden-root-pid']);
        this.pid = Number.isInteger(root) && root > 0 ? root : undefined;
        this.streams.attach(up.socket, up.head);
        if (!this.refed) this.streams.ref(false);
        this.emit('spawn');
        return this.treeId;
      }
      const row = await this.client.transport.json<Row>('POST', '/api/trees', { body: spawnBody(argv, opts) });
      this.treeId = row.id;
      const root = (row.root as { pid?: number } | undefined)?.pid ?? (row.root_pid as number | undefined);
      this.pid = typeof root === 'number' ? root : undefined;
      this.emit('spawn');
      return row.id;
    } catch (e) {
      this.streams?.fail(e);
      // Emitted on a later tick, so a listener added after spawn() sees it.
      queueMicrotask(() => {
        if (this.listenerCount('error') > 0) this.emit('error', e);
      });
      throw e;
    }
  }

  private async follow(): Promise<Outcome> {
    const id = await this.spawned;
    const t = this.client.transport;
    // Streamed: the exit frame says when the tree settled (after its
    // output's end); without it (the connection lost), the long poll.
    const streamed = this.streams ? await this.streams.exit : null;
    for (;;) {
      if (streamed && SETTLED.has(String(streamed.state))) break;
      // A long poll; shorter while other waits queue for a connection.
      const step = t.waitsQueued > 0 ? 500 : 30_000;
      const row = await t.json<Row>('GET', query(`/api/trees/${id}/wait`, { timeout: `${step}ms` }), {
        timeoutMs: step + 30_000,
        long: true,
        onSocket: (sock) => {
          this.waitSocket = sock;
          if (!this.refed) sock.unref();
        },
      });
      if (SETTLED.has(row.state)) break;
    }
    const o = outcomeOf(await this.detail());
    if (this.aborted) o.abortReason = this.abortReason;
    this.settledOutcome = o;
    this.exitCode = o.code;
    this.signalCode = o.signal;
    this.emit('exit', o.code, o.signal);
    this.emit('close', o.code, o.signal, o);
    return o;
  }

  /**
   * As `ChildProcess.unref()`: this process may exit while the tree runs
   * (the wait for its end no longer holds the event loop; the service
   * still tears it down when this process, its owner, exits).
   */
  unref(): this {
    this.refed = false;
    this.waitSocket?.unref();
    this.streams?.ref(false);
    return this;
  }

  /**
   * Hangs up the streamed stdio's connection: the tree's stdin is closed
   * and what it writes after is dropped; the tree itself lives by its
   * lifetime rules (its owner, its timeout), never by this connection.
   */
  disconnect(): void {
    this.streams?.close();
  }

  /** Undoes `unref()`. */
  ref(): this {
    this.refed = true;
    this.waitSocket?.ref();
    this.streams?.ref(true);
    return this;
  }

  /** The tree's whole record: members, signals, authorizations, events. */
  async detail(): Promise<Detail> {
    const id = await this.spawned;
    return this.client.transport.json<Detail>('GET', `/api/trees/${id}`);
  }

  /** The captured stdout and stderr. */
  async logs(): Promise<Buffer> {
    const id = await this.spawned;
    return (await this.client.transport.request('GET', `/api/trees/${id}/log`)).body;
  }

  private teardown(grace?: Duration): Promise<void> {
    if (this.kills) return this.kills;
    this.killed = true;
    const g = grace ?? this.grace;
    this.kills = (async () => {
      const id = await this.spawned;
      try {
        await this.client.transport.request(
          'POST',
          query(`/api/trees/${id}/kill`, { grace: g === undefined ? undefined : duration(g) }),
          { timeoutMs: durationMs(g) + 120_000 },
        );
      } catch (e) {
        // Already ended (NotFound/Conflict), or survivors left as evidence
        // (Ambiguous): the outcome says which.
        if (!(e instanceof NotFound || e instanceof Conflict || e instanceof Ambiguous)) throw e;
      }
    })();
    return quiet(this.kills);
  }

  /**
   * Starts the tree's teardown (first signal, grace, a committed
   * authorization, SIGKILL, verified), as `ChildProcess.kill` starts one:
   * `true` when asked for. The whole tree is torn down, whatever `signal`.
   */
  kill(_signal?: NodeJS.Signals | number): boolean {
    if (this.settledOutcome) return false;
    void this.teardown();
    return true;
  }

  /** Tears the tree down and answers how it ended. */
  async terminate(grace?: Duration): Promise<Outcome> {
    if (!this.settledOutcome) await this.teardown(grace);
    return this.outcome;
  }

  /** `await using t = client.spawn(...)`: torn down at the end of the scope. */
  async [Symbol.asyncDispose](): Promise<void> {
    try {
      await this.spawned;
    } catch {
      return; // nothing was created
    }
    if (!this.settledOutcome) {
      try {
        await this.teardown();
      } catch (e) {
        if (!(e instanceof TreewardenError)) throw e;
      }
    }
    await this.outcome.catch(() => undefined);
  }
}

function spawnBody(argv: readonly string[], opts: SpawnOptions): Record<string, unknown> {
  if (!Array.isArray(argv) || argv.length === 0 || argv.some((a) => typeof a !== 'string')) {
    throw new TypeError('argv is a non-empty array of strings (no shell)');
  }
  const me = ownIdentity();
  const body: Record<string, unknown> = { argv: [...argv], owner_pid: me.pid };
  if (me.startTicks !== undefined) body.owner_start_ticks = me.startTicks;
  if (opts.label !== undefined) body.label = opts.label;
  if (opts.grace !== undefined) body.grace = duration(opts.grace);
  if (opts.timeout !== undefined) body.timeout = duration(opts.timeout);
  if (opts.env !== undefined) body.env = { ...opts.env };
  if (opts.cwd !== undefined) body.cwd = path.resolve(opts.cwd);
  if (opts.limits !== undefined) body.limits = { ...opts.limits };
  if (opts.lifetime !== undefined && opts.lifetime !== 'root') body.lifetime = opts.lifetime;
  if (opts.firstSignal !== undefined) body.first_signal = opts.firstSignal;
  return body;
}

export interface ClientOptions extends Endpoint, TransportOptions {}

/** The service's API: over its Unix socket (default as the CLI finds it), or TCP with a token. */
export class Client {
  readonly transport: Transport;

  constructor(opts: ClientOptions = {}) {
    const ep: Endpoint = opts.url !== undefined ? opts : { ...opts, socketPath: opts.socketPath ?? defaultSocket() };
    this.transport = new Transport(ep, opts);
  }

  /** Starts `argv` as a tree owned by this process; answers at once. */
  spawn(argv: readonly string[], opts: SpawnOptions = {}): TreeProcess {
    return new TreeProcess(this, argv, opts);
  }

  /**
   * `execFile` with a timeout: runs `argv` as a tree, waits for its end,
   * and answers the outcome with the captured output. A timeout, a kill or
   * an abort is an outcome (`reason`), not a rejection; treewarden's own
   * failures reject.
   */
  async run(argv: readonly string[], opts: SpawnOptions = {}): Promise<RunResult> {
    const t = this.spawn(argv, opts);
    const o = await t.outcome;
    return { ...o, output: await t.logs() };
  }

  /** A tree by id, as its row. */
  async tree(id: number): Promise<Row> {
    return (await this.transport.json<Detail>('GET', `/api/trees/${id}`)).tree;
  }

  /** A tree's whole record. */
  async detail(id: number): Promise<Detail> {
    return this.transport.json<Detail>('GET', `/api/trees/${id}`);
  }

  /** Trees (one page): by `label`, `state`, or `alive`. */
  async trees(filter: { label?: string; state?: string; alive?: boolean } = {}): Promise<Row[]> {
    const all = filter.state === undefined && filter.alive === undefined ? true : undefined;
    return this.transport.json<Row[]>('GET', query('/api/trees', { ...filter, all }));
  }

  async health(): Promise<Record<string, unknown>> {
    return this.transport.json('GET', '/healthz');
  }
}
