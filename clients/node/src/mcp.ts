/**
 * `TreewardenStdioClientTransport`: the MCP TypeScript SDK's
 * `StdioClientTransport`, with the server launched in treewarden's custody.
 *
 * It implements the SDK's `Transport` (`start`, `send`, `close`,
 * `onmessage`, `onclose`, `onerror`) with the same framing as the SDK's
 * stdio transport (one JSON-RPC message per line, `\r\n` accepted, a
 * 10 MiB bound on a partial line) and takes the same server parameters
 * (`command`, `args`, `env` over the SDK's default environment, `cwd`,
 * `stderr`), so it is given to `Client.connect()` in its place:
 *
 *     const transport = new TreewardenStdioClientTransport({ command: 'npx', args: ['-y', 'some-server'] });
 *     await mcpClient.connect(transport);
 *
 * What differs is who holds the server. The SDK's transport spawns the
 * server as its own child and on close signals that child alone
 * (modelcontextprotocol/typescript-sdk#2023: a launcher's grandchild
 * survives), and nothing is signalled when the host crashes. Here the server
 * is a tree in the service's custody, owned by this process, its stdio
 * streamed over the spawn's connection:
 *
 * - it dies with its owner: the service tears it down within a second of
 *   this process's exit, however it exited;
 * - `close()` follows the MCP specification's order for the whole tree:
 *   stdin is closed, the server has `exitWait` to exit by itself, then the
 *   service's teardown does the rest (SIGTERM to every member, `grace`, a
 *   committed authorization, SIGKILL, verified empty).
 *
 * The SDK is no dependency of this package: the transport is structural
 * (what `Client.connect()` calls), and messages are checked as JSON-RPC
 * objects, leaving the schema to the SDK's protocol layer.
 */

import { createWriteStream } from 'node:fs';
import { PassThrough, type Readable, type Writable } from 'node:stream';

import { Client, type ClientOptions, type Duration, type Outcome, type SpawnOptions } from './client.js';
import { TreewardenError } from './errors.js';

/** A JSON-RPC 2.0 message, as the SDK's `JSONRPCMessage` (structurally). */
export interface JSONRPCMessage {
  jsonrpc: '2.0';
  [key: string]: unknown;
}

/** The environment variables a server inherits by default (the SDK's list). */
export const DEFAULT_INHERITED_ENV_VARS =
  process.platform === 'win32'
    ? ['APPDATA', 'HOMEDRIVE', 'HOMEPATH', 'LOCALAPPDATA', 'PATH', 'PROCESSOR_ARCHITECTURE', 'SYSTEMDRIVE', 'SYSTEMROOT', 'TEMP', 'USERNAME', 'USERPROFILE', 'PROGRAMFILES']
    : ['HOME', 'LOGNAME', 'PATH', 'SHELL', 'TERM', 'USER'];

/** This process's environment, cut to `DEFAULT_INHERITED_ENV_VARS` (shell functions left out). */
export function getDefaultEnvironment(): Record<string, string> {
  const env: Record<string, string> = {};
  for (const key of DEFAULT_INHERITED_ENV_VARS) {
    const value = process.env[key];
    if (value === undefined || value.startsWith('()')) continue;
    env[key] = value;
  }
  return env;
}

/** As the SDK's `StdioServerParameters`, and how treewarden holds the server. */
export interface TreewardenStdioServerParameters {
  command: string;
  args?: string[];
  /** Over `getDefaultEnvironment()`. */
  env?: Record<string, string>;
  cwd?: string;
  /**
   * The server's stderr: `'inherit'` (default: this process's), `'pipe'` or
   * `'overlapped'` (the `stderr` stream, there before `start()`),
   * `'ignore'`, a writable stream, or a descriptor.
   */
  stderr?: 'inherit' | 'pipe' | 'overlapped' | 'ignore' | Writable | number;
  /** The bound on a partial line (default 10 MiB, the SDK's). */
  maxBufferSize?: number;
  /** The treewarden client to spawn with (default: one on `clientOptions`, or the default socket). */
  client?: Client;
  clientOptions?: ClientOptions;
  /** The tree's label (default `mcp:COMMAND`). */
  label?: string;
  /** How long the server has to exit after its stdin closes (ms; default 2000, the SDK's). */
  exitWait?: number;
  /** The teardown's grace between SIGTERM and SIGKILL (default 2000 ms, the SDK's). */
  grace?: Duration;
}

/** The server could not be given streamed stdio: this client's `spawn` has none. */
export class NoStreamedStdio extends TreewardenError {
  constructor() {
    super('the client gave the tree no stdin/stdout streams: this service or client has no streamed stdio');
    this.name = 'NoStreamedStdio';
  }
}

/** The tree as `spawn(argv, { stdio: [...] })` answers it: `child_process`-shaped streams. */
interface StreamedTree {
  readonly stdin: Writable | null;
  readonly stdout: Readable | null;
  readonly stderr: Readable | null;
  readonly treeId: number | undefined;
  readonly pid: number | undefined;
  readonly spawned: Promise<number>;
  readonly outcome: Promise<Outcome>;
  terminate(grace?: Duration): Promise<Outcome>;
}

type StdioSlot = 'pipe' | 'inherit' | 'ignore';
type StreamedSpawn = (argv: readonly string[], opts: SpawnOptions & { stdio: readonly [StdioSlot, StdioSlot, StdioSlot] }) => StreamedTree;

const DEFAULT_MAX_BUFFER = 10 * 1024 * 1024;
const EXIT_WAIT_MS = 2000;
const GRACE_MS = 2000;

/** Newline-delimited JSON-RPC, as the SDK's `ReadBuffer`. */
class LineBuffer {
  private buf: Buffer | undefined;
  constructor(private readonly max: number) {}

  append(chunk: Buffer): void {
    const size = (this.buf?.length ?? 0) + chunk.length;
    if (size > this.max) {
      this.clear();
      throw new Error(`ReadBuffer exceeded maximum size of ${this.max} bytes`);
    }
    this.buf = this.buf ? Buffer.concat([this.buf, chunk]) : chunk;
  }

  /** The next whole line's message, `null` when no line is whole; throws for a line that is not JSON-RPC. */
  next(): JSONRPCMessage | null {
    if (!this.buf) return null;
    const i = this.buf.indexOf('\n');
    if (i === -1) return null;
    const line = this.buf.toString('utf8', 0, i).replace(/\r$/, '');
    this.buf = this.buf.subarray(i + 1);
    const v: unknown = JSON.parse(line);
    if (typeof v !== 'object' || v === null || Array.isArray(v) || (v as { jsonrpc?: unknown }).jsonrpc !== '2.0') {
      throw new Error(`not a JSON-RPC 2.0 message: ${line.slice(0, 200)}`);
    }
    return v as JSONRPCMessage;
  }

  clear(): void {
    this.buf = undefined;
  }
}

/** The SDK's `Transport` over a tree in custody. */
export class TreewardenStdioClientTransport {
  onclose?: () => void;
  onerror?: (error: Error) => void;
  onmessage?: (message: JSONRPCMessage, extra?: unknown) => void;

  private tree: StreamedTree | undefined;
  private started = false;
  private closed = false;
  private readonly read: LineBuffer;
  private readonly stderrStream: PassThrough | null;
  private readonly client: Client;
  /** How the tree ended, once `close()` or the server's own exit settled it. */
  outcome: Promise<Outcome> | undefined;

  constructor(private readonly server: TreewardenStdioServerParameters) {
    this.read = new LineBuffer(server.maxBufferSize ?? DEFAULT_MAX_BUFFER);
    this.stderrStream = server.stderr === 'pipe' || server.stderr === 'overlapped' ? new PassThrough() : null;
    this.client = server.client ?? new Client(server.clientOptions);
  }

  /** Spawns the server in custody; resolves once the tree is recorded and its stdio connected. */
  async start(): Promise<void> {
    if (this.started) {
      throw new Error('TreewardenStdioClientTransport already started! If using Client class, note that connect() calls start() automatically.');
    }
    this.started = true;
    const s = this.server;
    const err = s.stderr ?? 'inherit';
    const errSlot: StdioSlot = err === 'inherit' || err === 'ignore' ? err : 'pipe';
    const spawn = this.client.spawn.bind(this.client) as unknown as StreamedSpawn;
    const tree = spawn([s.command, ...(s.args ?? [])], {
      label: s.label ?? `mcp:${s.command}`,
      env: { ...getDefaultEnvironment(), ...s.env },
      cwd: s.cwd,
      grace: s.grace ?? GRACE_MS,
      stdio: ['pipe', 'pipe', errSlot],
    });
    try {
      await tree.spawned;
    } catch (e) {
      this.onerror?.(e as Error);
      throw e;
    }
    this.tree = tree;
    this.outcome = tree.outcome;
    void tree.outcome.then(
      () => this.ended(),
      () => this.ended(),
    );
    const { stdin, stdout, stderr } = tree;
    if (!stdin || !stdout) {
      const e = new NoStreamedStdio();
      await tree.terminate(0).catch(() => undefined);
      this.onerror?.(e);
      throw e;
    }
    stdin.on('error', (e: Error) => this.onerror?.(e));
    stdout.on('error', (e: Error) => this.onerror?.(e));
    stdout.on('data', (chunk: Buffer) => {
      try {
        this.read.append(chunk);
      } catch (e) {
        this.onerror?.(e as Error);
        void this.close().catch(() => undefined);
        return;
      }
      for (;;) {
        let message: JSONRPCMessage | null;
        try {
          message = this.read.next();
        } catch (e) {
          this.onerror?.(e as Error);
          continue;
        }
        if (message === null) break;
        this.onmessage?.(message);
      }
    });
    if (stderr) {
      if (this.stderrStream) stderr.pipe(this.stderrStream);
      else if (typeof err === 'number') stderr.pipe(createWriteStream('', { fd: err, autoClose: false }));
      else if (typeof err === 'object') stderr.pipe(err);
      else stderr.resume();
    }
  }

  /** The server's stderr with `stderr: 'pipe'` (there before `start()`), else `null`. */
  get stderr(): Readable | null {
    return this.stderrStream ?? (this.server.stderr === 'pipe' ? (this.tree?.stderr ?? null) : null);
  }

  /** The tree root's pid (the launcher's, for `npx`-style commands), once started. */
  get pid(): number | null {
    return this.tree?.pid ?? null;
  }

  /** The tree's id in the service's ledger, once started. */
  get treeId(): number | null {
    return this.tree?.treeId ?? null;
  }

  async send(message: JSONRPCMessage): Promise<void> {
    const stdin = this.tree?.stdin;
    if (!stdin || this.closed) throw new Error('Not connected');
    const line = JSON.stringify(message) + '\n';
    if (!stdin.write(line)) await new Promise<void>((resolve) => stdin.once('drain', () => resolve()));
  }

  /**
   * The specification's shutdown, for the whole tree: stdin closed,
   * `exitWait` for the server's own exit, then the service's teardown
   * (SIGTERM, `grace`, authorization, SIGKILL, verified). Resolves when
   * the tree has ended.
   */
  async close(): Promise<void> {
    const tree = this.tree;
    if (!tree || this.closed) {
      this.read.clear();
      return;
    }
    this.closed = true;
    try {
      tree.stdin?.end();
    } catch {
      // already closed: the wait below is what counts
    }
    const wait = this.server.exitWait ?? EXIT_WAIT_MS;
    let timer: NodeJS.Timeout | undefined;
    const exited = await Promise.race([
      tree.outcome.then(
        () => true,
        () => true,
      ),
      new Promise<boolean>((resolve) => {
        timer = setTimeout(() => resolve(false), wait);
      }),
    ]);
    clearTimeout(timer);
    if (!exited) {
      try {
        await tree.terminate(this.server.grace ?? GRACE_MS);
      } catch (e) {
        this.onerror?.(e as Error);
      }
    }
    this.read.clear();
  }

  private ended(): void {
    this.closed = true;
    this.tree?.stdout?.removeAllListeners('data');
    this.onclose?.();
  }
}
