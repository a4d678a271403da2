// Request a sidecar, wait for it to be ready on the hubd_events channel, read where it serves,
// and release it. The role in HUBD_DATABASE_URL needs only hubd_app (docs/api.md).
//   npm install && HUBD_DATABASE_URL="$(hubd db-url)" node wait_ready.mjs [provisioner]
import pg from "pg";

const provisioner = process.argv[2] ?? "local";
const timeoutMs = Number(process.env.HUBD_WAIT_MS ?? 60000);
const client = new pg.Client({ connectionString: process.env.HUBD_DATABASE_URL });
await client.connect();

const ended = new Set(["releasing", "released", "failed", "destroy_failed"]);
let id;
let wake = () => {};
client.on("notification", () => {
  // A hint that the feed moved ({"position": N}, nothing else); the view is the truth.
  wake();
});

try {
  // Listen first, then request: no event of the new allocation can come before the LISTEN.
  await client.query("LISTEN hubd_events");
  const requested = await client.query(
    "SELECT id FROM hubd_v1.request($1, session => $2, spec => $3)",
    [provisioner, "node-example", { example: "node" }],
  );
  id = requested.rows[0].id;
  console.log(`requested ${id}`);

  const deadline = Date.now() + timeoutMs;
  let row;
  for (;;) {
    const notified = new Promise((resolve) => { wake = resolve; });
    ({ rows: [row] } = await client.query(
      "SELECT ready, status, endpoint, metadata FROM hubd_v1.allocations WHERE id = $1", [id]));
    if (row.ready || ended.has(row.status)) break;
    const left = deadline - Date.now();
    if (left <= 0) throw new Error(`${id} not ready after ${timeoutMs} ms (${row.status})`);
    await Promise.race([notified, new Promise((resolve) => setTimeout(resolve, left))]);
  }
  if (!row.ready) throw new Error(`${id} ended before it was ready: ${row.status}`);
  console.log(`ready ${id} endpoint=${row.endpoint} metadata=${JSON.stringify(row.metadata)}`);

  const released = await client.query("SELECT status FROM hubd_v1.release($1, $2)",
    [id, "node example done"]);
  console.log(`released ${id} ${released.rows[0].status}`);
} finally {
  await client.end();
}
