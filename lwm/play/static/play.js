// lwm play: the page. One WebSocket; each request is answered by a state (JSON) and a frame (binary: a header
// <BBHHI kind, index, width, height, seq> then RGBA bytes). While an action key is held (past REPEAT_DELAY: a tap
// is one step), the next step is sent once the last frame is on screen, at most hold_fps times a second.
"use strict";

const HEADER = 10, FRAME = 0, PREVIEW = 1, REPEAT_DELAY = 250;  // ms, as a keyboard's own repeat delay
const $ = (id) => document.getElementById(id);
const lwm = window.lwm = {hello: null, state: null, stats: {latencies: [], shown: [], frames: 0}};
const ws = new WebSocket(`ws://${location.host}/ws`);
ws.binaryType = "arraybuffer";

let bindings = new Map();  // key -> binding
let seq = 0, inflight = false, queued = null, held = null, lastSend = 0;
const sentAt = new Map();  // seq -> time of the key press (or request) it answers

function send(message) {
  message.seq = ++seq;
  ws.send(JSON.stringify(message));
  return seq;
}

function request(message, pressedAt) {
  // one request in flight at a time: a key pressed meanwhile waits for the frame before
  if (inflight) { queued = {message, pressedAt}; return; }
  inflight = true;
  lastSend = performance.now();
  sentAt.set(send(message), pressedAt ?? lastSend);
}

function keyOf(event) { return event.key.length === 1 ? event.key.toLowerCase() : event.key; }

function typing(event) { return ["INPUT", "SELECT", "TEXTAREA"].includes(event.target.tagName); }

document.addEventListener("keydown", (event) => {
  if (typing(event) || event.ctrlKey || event.metaKey || event.altKey) return;
  const key = keyOf(event), binding = bindings.get(key);
  if (binding) {
    event.preventDefault();
    if (event.repeat) return;  // held: the page paces the steps itself
    held = {key, binding, since: performance.now()};
    request({op: "step", action: binding.action}, event.timeStamp);
    highlight(binding, true);
  } else if (key === "Backspace" || key === "z") {
    event.preventDefault();
    request({op: "undo"}, event.timeStamp);
  } else if (key === "r") {
    request({op: "reset"}, event.timeStamp);
  }
});

document.addEventListener("keyup", (event) => {
  const key = keyOf(event);
  if (held && held.key === key) { highlight(held.binding, false); held = null; }
});
window.addEventListener("blur", () => { if (held) highlight(held.binding, false); held = null; });

function pump() {
  // after a frame: a queued request, else the held key's next step (paced to hold_fps)
  if (inflight) return;
  if (queued) { const q = queued; queued = null; request(q.message, q.pressedAt); return; }
  if (!held) return;
  const fps = lwm.hello.hold_fps, now = performance.now();
  const wait = Math.max(fps > 0 ? lastSend + 1000 / fps - now : 0, held.since + REPEAT_DELAY - now);
  const key = held;  // the same press when the wait ends, not a later one
  const go = () => { if (held === key && !inflight) request({op: "step", action: key.binding.action}); };
  wait > 1 ? setTimeout(go, wait) : go();
}

ws.onmessage = (event) => {
  if (typeof event.data === "string") return onJSON(JSON.parse(event.data));
  const view = new DataView(event.data);
  const kind = view.getUint8(0), index = view.getUint8(1);
  const width = view.getUint16(2, true), height = view.getUint16(4, true), frameSeq = view.getUint32(6, true);
  const image = new ImageData(new Uint8ClampedArray(event.data, HEADER), width, height);
  const canvas = kind === FRAME ? $("frame") : document.querySelector(`#key-${index} canvas`);
  if (!canvas) return;
  if (canvas.width !== width || canvas.height !== height) { canvas.width = width; canvas.height = height; }
  canvas.getContext("2d").putImageData(image, 0, 0);
  if (kind !== FRAME) return;
  const pressedAt = sentAt.get(frameSeq);
  sentAt.delete(frameSeq);
  requestAnimationFrame(() => {  // the frame is on screen with this paint
    const now = performance.now();
    if (pressedAt !== undefined) lwm.stats.latencies.push(now - pressedAt);
    lwm.stats.shown.push(now);
    lwm.stats.frames += 1;
    hud(now);
  });
  inflight = false;
  pump();
};

function onJSON(message) {
  if (message.type === "hello") return build(message);
  if (message.type === "error") {
    $("message").textContent = message.message;
    if (message.seq) { inflight = false; sentAt.delete(message.seq); pump(); }
    return;
  }
  lwm.state = message;
  $("message").textContent = "";
  $("counter").textContent = `step ${message.step}`;
  $("ms").textContent = `model ${message.ms.toFixed(1)} ms`;
  $("world").textContent = `${JSON.stringify(message.world)}: ${message.world_source}`;
  $("note").textContent = message.past_trained ? "past the temporal positions training saw: later frames may drift" : "";
  $("undo").disabled = !message.can_undo;
  for (const ext of ["mp4", "gif", "json"]) $(`rec-${ext}`).href = `/record/${message.sid}.${ext}?n=${message.step}`;
}

function hud(now) {
  const shown = lwm.stats.shown, recent = shown.filter((t) => t > now - 1000);
  $("fps").textContent = `${recent.length.toFixed(1)} fps`;
  const last = lwm.stats.latencies.at(-1);
  if (last !== undefined) $("latency").textContent = `key→screen ${last.toFixed(0)} ms`;
  if (shown.length > 600) shown.splice(0, shown.length - 600);
}

function highlight(binding, on) {
  const i = lwm.hello.keys.indexOf(binding);
  const cell = $(`key-${i}`);
  if (cell) cell.classList.toggle("active", on);
}

function option(select, value, text) {
  const o = document.createElement("option");
  o.value = value; o.textContent = text; select.appendChild(o);
}

function build(hello) {
  lwm.hello = hello;
  bindings = new Map();
  hello.keys.forEach((b) => b.keys.forEach((k) => bindings.set(k, b)));
  $("about").textContent = `${hello.checkpoint} · step ${hello.global_step} · frames by ${hello.codec}` +
    (hello.codec_note ? ` (${hello.codec_note})` : "") + ` · window ${hello.window ?? "all"}`;
  const keys = $("keys");
  keys.innerHTML = "";
  hello.keys.slice(0, hello.number_keys).forEach((b, i) => {
    const cell = document.createElement("div");
    cell.className = "key"; cell.id = `key-${i}`;
    cell.innerHTML = `<b>${b.keys[0]}</b><canvas width="1" height="1"></canvas><small>${b.action.join(",")} · ${(100 * b.share).toFixed(0)}%</small>`;
    cell.title = b.label;
    keys.appendChild(cell);
  });
  const arrows = hello.keys.slice(hello.number_keys, -1);
  $("truekeys").innerHTML = arrows.length === 0 ? "<p>No arrow keys: the data has no true actions.</p>" :
    "<h2>Arrow keys / WASD: the code that most often goes with each true action</h2><table><tr><th>keys</th><th>true action → code</th><th>share of its transitions</th></tr>" +
    arrows.map((b, j) => `<tr id="key-${hello.number_keys + j}"><td>${b.keys.map((k) => `<kbd>${k.replace("Arrow", "")}</kbd>`).join(" ")}</td><td>${b.label}</td><td>${(100 * b.share).toFixed(0)}%</td></tr>`).join("") + "</table>";
  const noop = hello.keys.at(-1);
  $("noop").textContent = `no-op: ${noop.label}`;
  for (const id of ["world-file", "start-file"]) {
    $(id).innerHTML = "";
    hello.files.forEach((f, i) => option($(id), i, `${f.name} (${f.frames} frames)`));
  }
  $("world-dict").innerHTML = "";
  hello.worlds.forEach((w, i) => option($("world-dict"), i, `${JSON.stringify(w.indices)} · ${(100 * w.share).toFixed(1)}%`));
}

const number = (id) => Math.max(0, parseInt($(id).value, 10) || 0);
$("world-own").onclick = () => request({op: "world", mode: "own"});
$("world-dict-go").onclick = () => request({op: "world", mode: "dictionary", index: number("world-dict")});
$("world-clip-go").onclick = () => request({op: "world", mode: "clip", file: number("world-file"), frame: number("world-frame")});
$("start-go").onclick = () => request({op: "start", file: number("start-file"), frame: number("start-frame")});
$("reset").onclick = () => request({op: "reset"});
$("undo").onclick = () => request({op: "undo"});
// a control keeps no focus (Space or an arrow key would work it instead of playing)
document.querySelectorAll("button").forEach((b) => b.addEventListener("click", () => b.blur()));
document.querySelectorAll("select").forEach((s) => s.addEventListener("change", () => s.blur()));
setInterval(() => hud(performance.now()), 250);  // the rate falls to 0 once nothing is played
ws.onclose = () => { $("message").textContent = "disconnected from lwm play (reload the page once it runs again)"; };
