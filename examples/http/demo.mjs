// Request a sidecar over hubd's HTTP API, follow its events until it is ready, release it and
// wait for its end; each step is one JSON line on stdout.
//   HUBD_HTTP_URL=http://127.0.0.1:8080 HUBD_KEY=hubd_… node demo.mjs [provisioner]
import { Hubd } from "./client.mjs";

const hubd = new Hubd(process.env.HUBD_HTTP_URL, process.env.HUBD_KEY);
const provisioner = process.argv[2] ?? "local";
const say = (step, fields) => console.log(JSON.stringify({ step, ...fields }));

const made = await hubd.request(
  { provisioner, session: "node-http", spec: { example: "node" } },
  { idempotencyKey: `node-http-${process.pid}` },
);
say("requested", { id: made.id, tenant: made.tenant, status: made.status });

// Follow the allocation's events from before the request's own, until it is ready.
const seen = [];
const stop = new AbortController();
const timer = setTimeout(() => stop.abort(), 60_000);
for await (const event of hubd.events({ after: 0, allocationId: made.id, signal: stop.signal })) {
  seen.push(event.event);
  if (event.ready || ["releasing", "released", "failed"].includes(event.status)) break;
}
stop.abort();
clearTimeout(timer);
say("events", { events: seen });

const { allocation: ready, outcome } = await hubd.wait(made.id, { until: "ready" });
say("ready", { id: ready.id, outcome, ready: ready.ready, pid: ready.metadata?.pid ?? null });

await hubd.release(made.id, "node example done");
const { allocation: ended } = await hubd.wait(made.id, { until: "ended" });
say("ended", { id: ended.id, status: ended.status, end_reason: ended.end_reason });
