// A small client of hubd's HTTP API (docs/http.md) on Node.js's own fetch: no dependencies.
//   import { Hubd } from "./client.mjs";
//   const hubd = new Hubd("https://hubd.example:8080", process.env.HUBD_KEY);

export class HubdError extends Error {
  constructor(status, code, message, headers) {
    super(`${status} ${code}: ${message}`);
    this.status = status;
    this.code = code;
    this.retryAfter = Number(headers.get("retry-after") ?? "") || null;
  }
}

export class Hubd {
  constructor(baseUrl, key) {
    this.baseUrl = baseUrl.replace(/\/$/, "");
    this.key = key;
  }

  async call(method, path, body, headers = {}) {
    const response = await fetch(this.baseUrl + path, {
      method,
      headers: {
        Authorization: `Bearer ${this.key}`,
        ...(body === undefined ? {} : { "Content-Type": "application/json" }),
        ...headers,
      },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const answer = await response.json();
    if (!response.ok) {
      const { code, message } = answer.error;
      throw new HubdError(response.status, code, message, response.headers);
    }
    return { answer, headers: response.headers };
  }

  // A retry with the same idempotencyKey returns the same allocation, never a second one.
  async request(wanted, { idempotencyKey } = {}) {
    const headers = idempotencyKey ? { "Idempotency-Key": idempotencyKey } : {};
    return (await this.call("POST", "/v1/allocations", wanted, headers)).answer;
  }

  async get(id) {
    return (await this.call("GET", `/v1/allocations/${encodeURIComponent(id)}`)).answer;
  }

  async list(query = {}) {
    const search = new URLSearchParams(query).toString();
    return (await this.call("GET", `/v1/allocations${search ? `?${search}` : ""}`)).answer
      .allocations;
  }

  async release(id, reason) {
    const path = `/v1/allocations/${encodeURIComponent(id)}/release`;
    return (await this.call("POST", path, reason ? { reason } : {})).answer;
  }

  async extend(id, lifetimeSeconds) {
    const path = `/v1/allocations/${encodeURIComponent(id)}/extend`;
    return (await this.call("POST", path, { lifetime_s: lifetimeSeconds })).answer;
  }

  async touch(id) {
    return (await this.call("POST", `/v1/allocations/${encodeURIComponent(id)}/touch`)).answer;
  }

  // The allocation once ready (or ended, or at the timeout): { allocation, outcome }.
  async wait(id, { until = "ready", timeoutSeconds = 60 } = {}) {
    const path = `/v1/allocations/${encodeURIComponent(id)}/wait?until=${until}` +
      `&timeout=${timeoutSeconds}`;
    const { answer, headers } = await this.call("GET", path);
    return { allocation: answer, outcome: headers.get("hubd-wait") };
  }

  // The tenant's events as they commit, from after position `after` (or from now). Keep the
  // last position handled: passing it again resumes with nothing missed or repeated.
  async *events({ after, allocationId, session, signal } = {}) {
    const query = new URLSearchParams();
    if (after !== undefined) query.set("after", String(after));
    if (allocationId) query.set("allocation_id", allocationId);
    if (session) query.set("session", session);
    const response = await fetch(`${this.baseUrl}/v1/events?${query}`, {
      headers: { Authorization: `Bearer ${this.key}` },
      signal,
    });
    if (!response.ok) {
      const { error } = await response.json();
      throw new HubdError(response.status, error.code, error.message, response.headers);
    }
    const decoder = new TextDecoder();
    let buffered = "";
    for await (const chunk of response.body) {
      buffered += decoder.decode(chunk, { stream: true });
      let end;
      while ((end = buffered.indexOf("\n\n")) >= 0) {
        const block = buffered.slice(0, end);
        buffered = buffered.slice(end + 2);
        const fields = {};
        for (const line of block.split("\n")) {
          if (line.startsWith(":")) continue; // a heartbeat
          const at = line.indexOf(": ");
          if (at > 0) fields[line.slice(0, at)] = line.slice(at + 2);
        }
        if (fields.event === "error") throw new Error(`the stream ended: ${fields.data}`);
        if (fields.data) yield JSON.parse(fields.data);
      }
    }
  }
}
