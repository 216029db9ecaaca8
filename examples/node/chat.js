#!/usr/bin/env node
// Send one turn and print what streams back:
//   node chat.js --state-dir DIR SESSION TEXT [--env NAME=VALUE ...] [--approve CHOICE]
// Without --approve, an approval the turn asks for is denied.
//   node chat.js --connection FILE SESSION TEXT
"use strict";

const { HermesSup } = require("./hermes-sup");

function parse(argv) {
  const opts = { sessionEnv: {}, positional: [] };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--state-dir") opts.stateDir = argv[++i];
    else if (arg === "--connection") opts.connectionFile = argv[++i];
    else if (arg === "--approve") opts.approve = argv[++i];
    else if (arg === "--env") {
      const [name, ...rest] = argv[++i].split("=");
      opts.sessionEnv[name] = rest.join("=");
    } else opts.positional.push(arg);
  }
  if (opts.positional.length !== 2 || !(opts.stateDir || opts.connectionFile)) {
    console.error("usage: chat.js (--state-dir DIR | --connection FILE) SESSION TEXT");
    process.exit(2);
  }
  return opts;
}

async function main() {
  const opts = parse(process.argv.slice(2));
  const [session, text] = opts.positional;
  let hs;
  try {
    hs = new HermesSup({ stateDir: opts.stateDir, connectionFile: opts.connectionFile });
    const pong = await hs.ping();
    console.log(`connected to hermes-sup ${pong.version} (protocol ${pong.protocol})`);
    if (Object.keys(opts.sessionEnv).length) await hs.open(session, { session_env: opts.sessionEnv });
    for await (const event of hs.send(session, text)) {
      if (event.type === "token") process.stdout.write(event.data);
      else if (event.type === "output") console.log(`output: ${event.data}`);
      else if (event.type === "approval") {
        console.log(`approval requested: ${event.data.command}`);
        // Nobody is there to ask: without --approve the answer is deny, at
        // once, rather than a turn that waits for an answer that never comes.
        const choice = opts.approve || "deny";
        if (!opts.approve) console.log("denied (no --approve given; --approve once allows it)");
        await hs.approve(session, choice, event.data.id);
      } else if (event.type === "reply") console.log(`\nreply: ${event.text}`);
      else console.log(`${event.type}: ${JSON.stringify(event.data)}`);
    }
  } catch (err) {
    console.error(`error: ${err.message}`);
    process.exitCode = 1;
  } finally {
    if (hs) hs.close();
  }
}

main();
