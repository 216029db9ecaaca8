// The chat page's logic: Hermes's runs API with fetch, its events read as
// SSE from a fetch body (EventSource cannot send the bearer key).
//
//   POST /v1/runs {input}              -> {run_id}
//   GET  /v1/runs/{id}/events          -> data: {"event": "message.delta", ...} ...
//   POST /v1/runs/{id}/approval        {choice}
//   POST /v1/runs/{id}/stop
"use strict";

// One session per tab: sessionStorage is per tab, and survives a reload.
let session = sessionStorage.getItem("hermes-sup-session");
if (!session) {
  session = "web:" + crypto.getRandomValues(new Uint32Array(2)).join("");
  sessionStorage.setItem("hermes-sup-session", session);
}
document.getElementById("session").textContent = session;

// The API key is typed or pasted by the person using the page; it stays in
// this tab (sessionStorage), never in the page's files.
const keyInput = document.getElementById("key");
keyInput.value = sessionStorage.getItem("hermes-sup-key") || "";
keyInput.addEventListener("input", () => sessionStorage.setItem("hermes-sup-key", keyInput.value.trim()));

const log = document.getElementById("log");

function add(cls, text) {
  const div = document.createElement("div");
  div.className = "msg " + cls;
  if (text !== undefined) div.textContent = text;
  log.appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function headers() {
  return {
    Authorization: "Bearer " + keyInput.value.trim(),
    "Content-Type": "application/json",
    "X-Hermes-Session-Key": session,
  };
}

async function api(method, path, body) {
  const response = await fetch(path, {
    method,
    headers: headers(),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    const error = data.error || {};
    throw new Error(`${error.message || response.statusText} [${error.code || response.status}]`);
  }
  return data;
}

// Each SSE event of a fetch body, as parsed JSON (lines "data: {...}").
async function* sse(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data: "))
        .map((line) => line.slice(6))
        .join("\n");
      if (data) yield JSON.parse(data);
    }
  }
}

function showApproval(bubble, runId, event) {
  const box = document.createElement("div");
  box.className = "msg approval";
  box.dataset.testid = "approval";
  box.appendChild(document.createTextNode("Allow this command? "));
  const code = document.createElement("code");
  code.textContent = event.command;
  box.appendChild(code);
  box.appendChild(document.createElement("br"));
  for (const choice of event.choices || ["once", "deny"]) {
    const button = document.createElement("button");
    button.textContent = choice;
    button.dataset.choice = choice;
    button.onclick = async () => {
      box.querySelectorAll("button").forEach((b) => (b.disabled = true));
      try {
        await api("POST", `/v1/runs/${runId}/approval`, { choice });
        box.appendChild(document.createTextNode(` answered: ${choice}`));
      } catch (error) {
        box.appendChild(document.createTextNode(` ${error.message}`));
      }
    };
    box.appendChild(button);
  }
  bubble.insertBefore(box, bubble.querySelector(".text"));
}

function note(bubble, cls, text) {
  const pre = document.createElement("pre");
  pre.className = cls;
  pre.textContent = text;
  bubble.insertBefore(pre, bubble.querySelector(".text"));
}

function finish(bubble, how, text) {
  bubble.dataset.done = how;
  if (text !== undefined) bubble.querySelector(".text").textContent = text;
  const meta = bubble.querySelector(".meta");
  meta.textContent = how === "reply" ? "done" : how;
}

function apply(bubble, state, runId, event) {
  const text = bubble.querySelector(".text");
  switch (event.event) {
    case "message.delta":
      state.tokens += 1;
      bubble.dataset.tokens = state.tokens;
      text.textContent += event.delta;
      break;
    case "reasoning.available":
      note(bubble, "reasoning", event.text);
      break;
    case "tool.started":
      note(bubble, "tool", `⚙ ${event.tool}${event.preview ? ": " + event.preview : ""}`);
      break;
    case "approval.request":
      showApproval(bubble, runId, event);
      break;
    case "approval.responded":
      if (event.reason === "timeout") note(bubble, "meta", "no answer in time: denied");
      break;
    case "run.completed":
      finish(bubble, "reply", state.tokens ? undefined : event.output);
      break;
    case "run.failed":
      bubble.classList.add("error");
      finish(bubble, "error", event.error);
      break;
    case "run.cancelled":
      finish(bubble, "cancelled", text.textContent || "(stopped)");
      break;
  }
}

async function turn(message) {
  add("user", message);
  const bubble = add("agent");
  bubble.innerHTML = '<div class="meta">sending…</div><div class="text"></div>';
  const state = { tokens: 0 };
  try {
    const { run_id: runId } = await api("POST", "/v1/runs", { input: message, session_id: session });
    const meta = bubble.querySelector(".meta");
    meta.textContent = "running";
    const stop = document.createElement("button");
    stop.className = "stop";
    stop.textContent = "Stop";
    stop.onclick = () => api("POST", `/v1/runs/${runId}/stop`).catch(() => {});
    meta.appendChild(stop);
    const response = await fetch(`/v1/runs/${runId}/events`, { headers: headers() });
    if (!response.ok) throw new Error(`events: ${response.status}`);
    for await (const event of sse(response)) {
      apply(bubble, state, runId, event);
      if (bubble.dataset.done) break;
    }
    if (!bubble.dataset.done) throw new Error("the connection closed [closed]");
  } catch (error) {
    bubble.classList.add("error");
    finish(bubble, "error", error.message);
  }
}

document.getElementById("form").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = document.getElementById("text");
  const message = input.value.trim();
  input.value = "";
  if (message) turn(message);
});
