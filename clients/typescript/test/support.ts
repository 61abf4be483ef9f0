/**
 * A real `fencegate serve` for the tests: the venv's `fencegate` (../../.venv/bin), or
 * the one named by FENCEGATE_BIN, or `fencegate` on PATH; a temporary config with free
 * ports and a recording upstream (a tiny node http server); a `redis-server` of our own
 * for the BullMQ test. Every process started here is stopped by `stop()`.
 */

import { spawn, type ChildProcess } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createServer, type AddressInfo, type Server } from "node:net";
import http from "node:http";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

export const WORKER_TOKEN = "worker-token-for-the-typescript-tests";
export const ADMIN_TOKEN = "admin-token-for-the-typescript-tests";

const here = path.dirname(fileURLToPath(import.meta.url));
const repository = path.resolve(here, "../../../..");

export function fencegateBin(): string {
  if (process.env.FENCEGATE_BIN) return process.env.FENCEGATE_BIN;
  const venv = path.join(repository, ".venv", "bin", "fencegate");
  return existsSync(venv) ? venv : "fencegate";
}

export async function freePort(): Promise<number> {
  const server: Server = createServer();
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address() as AddressInfo;
  await new Promise<void>((resolve) => server.close(() => resolve()));
  return port;
}

export interface Received {
  method: string;
  path: string;
  headers: http.IncomingHttpHeaders;
  body: string;
}

/** An upstream that answers 201 with a count and records what reached it. */
export class Upstream {
  readonly received: Received[] = [];
  private server: http.Server | undefined;
  url = "";

  async start(): Promise<void> {
    this.server = http.createServer((req, res) => {
      const chunks: Buffer[] = [];
      req.on("data", (c: Buffer) => chunks.push(c));
      req.on("end", () => {
        this.received.push({
          method: req.method ?? "",
          path: req.url ?? "",
          headers: req.headers,
          body: Buffer.concat(chunks).toString(),
        });
        res.writeHead(201, { "Content-Type": "application/json" });
        res.end(JSON.stringify({ applied: this.received.length }));
      });
    });
    await new Promise<void>((resolve) => this.server!.listen(0, "127.0.0.1", resolve));
    this.url = `http://127.0.0.1:${(this.server.address() as AddressInfo).port}`;
  }

  async stop(): Promise<void> {
    if (this.server === undefined) return;
    this.server.closeAllConnections();
    await new Promise<void>((resolve) => this.server!.close(() => resolve()));
  }
}

async function waitFor(what: string, ready: () => Promise<boolean>, child: ChildProcess, log: () => string): Promise<void> {
  const deadline = Date.now() + 30_000;
  while (Date.now() < deadline) {
    if (child.exitCode !== null) throw new Error(`${what} exited early:\n${log()}`);
    if (await ready().catch(() => false)) return;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`${what} did not become ready:\n${log()}`);
}

export class Gateway {
  readonly upstream = new Upstream();
  private child: ChildProcess | undefined;
  private output = "";
  private home = "";
  proxyUrl = "";
  controlUrl = "";

  async start(): Promise<void> {
    await this.upstream.start();
    this.home = mkdtempSync(path.join(tmpdir(), "fencegate-ts-"));
    const [proxy, control] = [await freePort(), await freePort()];
    this.proxyUrl = `http://127.0.0.1:${proxy}`;
    this.controlUrl = `http://127.0.0.1:${control}`;
    const config = path.join(this.home, "fencegate.toml");
    writeFileSync(
      config,
      `database_url = "sqlite+aiosqlite:///fencegate.db"
proxy_listen = "127.0.0.1:${proxy}"
control_listen = "127.0.0.1:${control}"

[auth]
worker_tokens = ["${WORKER_TOKEN}"]
admin_tokens = ["${ADMIN_TOKEN}"]

[lease]
default_ttl_seconds = 30

[[upstreams]]
name = "pay"
url = "${this.upstream.url}"
timeout_seconds = 5

[[upstreams]]
name = "payments"
url = "${this.upstream.url}"
timeout_seconds = 5
`,
    );
    const child = spawn(fencegateBin(), ["serve", "--config", config, "--log-level", "WARNING"], {
      stdio: ["ignore", "pipe", "pipe"],
    });
    this.child = child;
    child.stdout?.on("data", (d: Buffer) => (this.output += d.toString()));
    child.stderr?.on("data", (d: Buffer) => (this.output += d.toString()));
    await waitFor(
      "fencegate serve",
      async () => (await fetch(`${this.controlUrl}/healthz`)).ok,
      child,
      () => this.output,
    );
  }

  async stop(): Promise<void> {
    await stopChild(this.child);
    await this.upstream.stop();
    if (this.home) rmSync(this.home, { recursive: true, force: true });
  }
}

export class Redis {
  private child: ChildProcess | undefined;
  private output = "";
  port = 0;

  async start(): Promise<void> {
    this.port = await freePort();
    const child = spawn(
      process.env.REDIS_SERVER_BIN ?? "redis-server",
      ["--port", String(this.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
      { stdio: ["ignore", "pipe", "pipe"] },
    );
    this.child = child;
    child.stdout?.on("data", (d: Buffer) => (this.output += d.toString()));
    child.stderr?.on("data", (d: Buffer) => (this.output += d.toString()));
    await waitFor("redis-server", async () => this.output.includes("Ready to accept"), child, () => this.output);
  }

  async stop(): Promise<void> {
    await stopChild(this.child);
  }
}

export async function stopChild(child: ChildProcess | undefined): Promise<void> {
  if (child === undefined || child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()));
  child.kill("SIGCONT");
  child.kill("SIGTERM");
  const timer = setTimeout(() => child.kill("SIGKILL"), 5_000);
  await exited;
  clearTimeout(timer);
}
