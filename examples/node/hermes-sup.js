// A minimal hermes-sup client, written from protocol/PROTOCOL.md alone.
//
// One DEALER socket; every message is three frames: "HSUP/1", an
// HMAC-SHA256 of the payload, and the payload (a msgpack map, the envelope).
// Answers are matched to requests by `re`.
"use strict";

const crypto = require("node:crypto");
const fs = require("node:fs");
const path = require("node:path");
const zmq = require("zeromq");
const { encode, decode } = require("@msgpack/msgpack");

const MAGIC = Buffer.from("HSUP/1");

class SupervisorError extends Error {
  constructor(code, message) {
    super(`${message} [${code}]`);
    this.code = code;
  }
}

class HermesSup {
  // Local: new HermesSup({ stateDir }). Remote: new HermesSup({ connectionFile }).
  constructor({ stateDir, connectionFile, timeoutMs = 10000 }) {
    this.timeoutMs = timeoutMs;
    this.socket = new zmq.Dealer({ linger: 0 });
    if (connectionFile) {
      if (fs.statSync(connectionFile).mode & 0o077) {
        // It holds a secret key and the signing key, like an ssh key file.
        throw new Error(`${connectionFile} is readable by others; chmod 600 it`);
      }
      const conn = JSON.parse(fs.readFileSync(connectionFile, "utf8"));
      this.key = Buffer.from(conn.hmac_key, "hex");
      this.socket.curveServerKey = conn.curve.server_public;
      this.socket.curvePublicKey = conn.curve.public;
      this.socket.curveSecretKey = conn.curve.secret;
      this.socket.connect(conn.endpoint);
    } else {
      this.key = Buffer.from(fs.readFileSync(path.join(stateDir, "hmac.key"), "utf8").trim(), "hex");
      this.socket.connect(`ipc://${path.join(stateDir, "control.sock")}`);
    }
    this.waiting = new Map(); // request id -> { push(msg) }
    this.reading = this._read().catch(() => {}); // ends when the socket closes
  }

  _sign(payload) {
    return crypto.createHmac("sha256", this.key).update(payload).digest();
  }

  async _read() {
    for await (const frames of this.socket) {
      if (frames.length !== 3 || !frames[0].equals(MAGIC)) continue;
      const expected = this._sign(frames[2]);
      if (frames[1].length !== expected.length || !crypto.timingSafeEqual(frames[1], expected)) {
        continue; // not signed with our key: not our supervisor
      }
      const msg = decode(frames[2]);
      const waiter = this.waiting.get(msg.re);
      if (waiter) waiter.push(msg);
    }
  }

  async _send(id, kind, body = {}, session = null) {
    // ttl: the supervisor refuses the request once we have stopped waiting for it.
    const envelope = { id, kind, ts: Date.now() / 1000, ttl: this.timeoutMs / 1000, session, re: null, body };
    const payload = Buffer.from(encode(envelope));
    await this.socket.send([MAGIC, this._sign(payload), payload]);
  }

  // Yields every answer to one request until `isLast(msg)`; errors throw.
  async *_answers(kind, body, session, isLast) {
    const queue = [];
    let wake = null;
    const id = crypto.randomBytes(16).toString("hex");
    // Listen before sending: the answer may arrive before send() resolves.
    this.waiting.set(id, { push: (m) => { queue.push(m); if (wake) wake(); } });
    try {
      await this._send(id, kind, body, session);
      for (;;) {
        if (queue.length === 0) {
          let timer;
          const timedOut = await new Promise((resolve) => {
            wake = () => resolve(false);
            timer = setTimeout(() => resolve(true), this.timeoutMs);
          });
          clearTimeout(timer);
          wake = null;
          if (timedOut && queue.length === 0) {
            throw new Error(`the supervisor did not answer within ${this.timeoutMs} ms`);
          }
          continue;
        }
        const msg = queue.shift();
        if (msg.kind === "error") throw new SupervisorError(msg.body.code, msg.body.message);
        yield msg;
        if (isLast(msg)) return;
      }
    } finally {
      this.waiting.delete(id);
    }
  }

  async request(kind, body = {}, session = null) {
    for await (const msg of this._answers(kind, body, session, () => true)) return msg;
  }

  ping() {
    return this.request("ping").then((m) => m.body);
  }

  open(session, options) {
    return this.request("open", options ? { options } : {}, session).then((m) => m.body);
  }

  // A turn: yields { type, data } events as they stream, then { type: "reply", text, ok, data }.
  async *send(session, text) {
    // The timeout covers each wait between messages; a long turn keeps streaming.
    for await (const msg of this._answers("send", { text }, session, (m) => m.kind !== "event")) {
      if (msg.kind === "event") yield { type: msg.body.type, data: msg.body.data };
      else yield { type: "reply", text: msg.body.text, ok: msg.body.ok, data: msg.body.data };
    }
  }

  // Answer the approval waiting in `session`; with `approval` (the request's
  // data.id), only that one: a late answer never approves another command.
  approve(session, choice, approval) {
    const body = approval ? { choice, approval } : { choice };
    return this.request("approve", body, session).then((m) => m.body);
  }

  close() {
    this.socket.close();
  }
}

module.exports = { HermesSup, SupervisorError };
