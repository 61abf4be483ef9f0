/**
 * docs/typescript.md's examples, word for word: each ```ts block of the page is a file
 * of examples/ (compiled with the package), and each runs against a real gateway.
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { readFileSync } from "node:fs";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

import { Gateway, Redis, WORKER_TOKEN } from "./support.js";

const run = promisify(execFile);
const gateway = new Gateway();
const redis = new Redis();
before(() => Promise.all([gateway.start(), redis.start()]));
after(() => Promise.all([gateway.stop(), redis.stop()]));

const source = (relative: string): string =>
  readFileSync(new URL(relative, import.meta.url), "utf8");
const EXAMPLES = ["worker.ts", "bullmq-worker.ts"];

test("every ts block of docs/typescript.md is an example file, as it is", () => {
  const page = source("../../../../docs/typescript.md");
  const blocks = [...page.matchAll(/^```ts\n(.*?)^```$/gms)].map((m) => m[1]);
  const files = EXAMPLES.map((name) => source(`../../examples/${name}`));
  assert.deepEqual(blocks, files);
});

async function example(name: string): Promise<string> {
  const { stdout } = await run(
    process.execPath,
    [fileURLToPath(new URL(`../examples/${name}`, import.meta.url))],
    {
      env: {
        ...process.env,
        FENCEGATE_CONTROL: gateway.controlUrl,
        FENCEGATE_PROXY: gateway.proxyUrl,
        FENCEGATE_WORKER_TOKEN: WORKER_TOKEN,
        REDIS_PORT: String(redis.port),
      },
      timeout: 60_000,
    },
  );
  return stdout;
}

test("the worker example charges and completes", async () => {
  const out = await example("worker.js");
  assert.match(out, /^charged 201 /m);
  const charge = gateway.upstream.received.at(-1)!;
  assert.equal(charge.path, "/v1/charges");
  assert.equal(charge.headers["idempotency-key"], "charge-9");
});

test("the BullMQ example charges through a fenced processor", async () => {
  const out = await example("bullmq-worker.js");
  assert.match(out, /^charged \{/m);
  const charge = gateway.upstream.received.at(-1)!;
  assert.equal(charge.headers["idempotency-key"], "charge-10");
  assert.equal(charge.headers["fencing-job"], "bullmq:charges:1");
});
