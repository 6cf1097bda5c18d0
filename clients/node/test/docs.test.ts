/**
 * The example of docs/INTEGRATION.md ("From Node") runs as printed, against
 * a real `serve`, with this package, and prints what the page says. The
 * page is found in TREEWARDEN_REPO (tests/run's lane runs a copy of this
 * package), else in the checkout this package sits in.
 */

import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import * as path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { promisify } from 'node:util';
import { test } from 'node:test';

import { REPO, Server, binary, marked, waitUntil } from './server.js';

const DOC = path.join(process.env.TREEWARDEN_REPO || REPO, 'docs', 'INTEGRATION.md');
const INDEX = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', 'src', 'index.js');
const HEADING = '### From Node';

/** The first fenced block of `lang` after `from` in `text`. */
function fencedAfter(text: string, from: number, lang: string): { body: string; end: number } {
  const open = '```' + lang + '\n';
  const start = text.indexOf(open, from);
  assert.ok(start >= 0, `no \`\`\`${lang} block after ${HEADING}`);
  const end = text.indexOf('\n```', start + open.length);
  return { body: text.slice(start + open.length, end + 1), end };
}

const skip = !binary()
  ? 'skipped: no treewarden binary (cargo build, or set TREEWARDEN_BIN)'
  : !existsSync(DOC)
    ? `skipped: ${DOC} not found (set TREEWARDEN_REPO)`
    : false;

test('the INTEGRATION.md example runs as printed', { skip }, async () => {
  const doc = readFileSync(DOC, 'utf8');
  const at = doc.indexOf(HEADING);
  assert.ok(at >= 0, `no ${HEADING} in ${DOC}`);
  const script = fencedAfter(doc, at, 'js');
  const expected = fencedAfter(doc, script.end, 'text').body;
  const s = await Server.start();
  try {
    const file = path.join(s.dir, 'example.mjs');
    writeFileSync(file, script.body.replaceAll("'@treewarden/client'", `'${pathToFileURL(INDEX).href}'`));
    const { stdout } = await promisify(execFile)(process.execPath, [file], {
      env: { ...process.env, TREEWARDEN_SOCKET: s.socket, TW_NODE_MARK: s.mark },
      timeout: 60_000,
    });
    assert.equal(stdout, expected);
    assert.deepEqual(await s.client().trees({ alive: true }), []);
    assert.ok(await waitUntil(() => marked(s.mark).length === 0, 10), `left: ${marked(s.mark)}`);
  } finally {
    await s.close();
  }
});
