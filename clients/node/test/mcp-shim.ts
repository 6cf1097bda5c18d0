/**
 * An `npx`-style launcher: it *spawns* the real server as its child (its
 * stdio inherited) and waits for it, so the server is a grandchild of
 * whoever started the shim (modelcontextprotocol/typescript-sdk#2023's
 * shape). On SIGTERM it exits without passing the signal on, as npx does.
 *
 *     node mcp-shim.js PIDFILE -- ARGV...
 */

import { spawn } from 'node:child_process';
import { appendFileSync } from 'node:fs';

const args = process.argv.slice(2);
const sep = args.indexOf('--');
appendFileSync(args[0]!, `shim ${process.pid}\n`);
process.on('SIGTERM', () => process.exit(143));
const child = spawn(args[sep + 1]!, args.slice(sep + 2), { stdio: 'inherit' });
child.on('exit', (code, signal) => process.exit(code ?? (signal ? 128 : 1)));
