// kvmux's page: chat with durable sessions, and the daemon's dashboard.
// No framework and no build. Everything the model writes reaches the
// document as text nodes (markdown() below builds elements itself), so no
// HTML from a reply can run; the page's Content-Security-Policy forbids
// any script but this file besides.
(() => {
  "use strict";

  const $ = (id) => document.getElementById(id);
  const SESSION = "X-Kvmux-Session";
  const DEFAULTS = { system: "", temperature: 0.7, top_p: 0.95, max_tokens: 512, model: "kvmux" }; // kvmux: the daemon's default model

  // ------------------------------------------------------------- storage
  // This browser's conversations: their titles, durable session ids,
  // displayed messages and settings. A session outlives the page, the
  // gateway and the daemon, so a conversation resumes from its id.

  const stored = (name, fallback) => {
    try {
      return JSON.parse(localStorage.getItem(`kvmux.${name}`)) ?? fallback;
    } catch {
      return fallback;
    }
  };
  const keep = (name, value) => localStorage.setItem(`kvmux.${name}`, JSON.stringify(value));

  let conversations = stored("conversations", []);
  let activeId = stored("active", null);
  let key = stored("key", "");
  let running = null; // {controller, conv}: the reply being streamed
  const summaries = new Map(); // session id -> the broker's summary of it

  const save = () => {
    keep("conversations", conversations);
    keep("active", activeId);
  };
  const active = () => conversations.find((c) => c.id === activeId);

  function newConversation() {
    const last = stored("settings", DEFAULTS);
    const conv = { id: crypto.randomUUID(), title: "", session: null, messages: [], ...DEFAULTS, ...last, created: Date.now() };
    conversations.unshift(conv);
    activeId = conv.id;
    save();
    return conv;
  }

  // ------------------------------------------------------------ markdown
  // Escape everything: text goes in as text nodes, and only these
  // elements are made: p, br, h3-h6, ul/ol/li, blockquote, pre/code,
  // strong, em, and a with an http(s) href.

  function el(tag, text) {
    const node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/;
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+/;
  const QUOTE = /^\s*>\s?/;
  const INLINE = new RegExp(
    [
      "(`+)([\\s\\S]*?[^`])\\1(?!`)", // code span: 1, 2
      "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*", // bold: 3
      "__(?=\\S)([\\s\\S]*?\\S)__", // bold: 4
      "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*", // italic: 5
      "(?<!\\w)_(?=[^\\s_])([\\s\\S]*?[^\\s_])_(?!\\w)", // italic: 6
      "\\[([^\\]\\n]+)\\]\\(([^()\\s]+)\\)", // link: 7, 8
    ].join("|"),
  );

  function inline(text, parent) {
    while (text) {
      const m = INLINE.exec(text);
      if (!m) {
        parent.append(text);
        return;
      }
      if (m.index) parent.append(text.slice(0, m.index));
      if (m[1]) {
        parent.append(el("code", m[2]));
      } else if (m[3] !== undefined || m[4] !== undefined) {
        const strong = el("strong");
        inline(m[3] ?? m[4], strong);
        parent.append(strong);
      } else if (m[5] !== undefined || m[6] !== undefined) {
        const em = el("em");
        inline(m[5] ?? m[6], em);
        parent.append(em);
      } else if (/^https?:\/\//i.test(m[8])) {
        const a = el("a");
        a.href = m[8];
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        inline(m[7], a);
        parent.append(a);
      } else {
        parent.append(m[0]); // a link to anything but http(s): its text as written
      }
      text = text.slice(m.index + m[0].length);
    }
  }

  function markdown(text) {
    const out = document.createDocumentFragment();
    const lines = text.split("\n");
    const plain = (line) => line.trim() && !FENCE.test(line) && !HEADING.test(line) && !ITEM.test(line) && !QUOTE.test(line);
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(FENCE);
      if (fence) {
        const body = [];
        for (i += 1; i < lines.length && !lines[i].trim().startsWith(fence[1]); i += 1) body.push(lines[i]);
        i += 1; // the closing fence (a reply still streaming has none yet)
        const code = el("code", body.join("\n"));
        if (fence[2]) code.dataset.lang = fence[2];
        const pre = el("pre");
        pre.append(code);
        out.append(pre);
      } else if (!line.trim()) {
        i += 1;
      } else if (HEADING.test(line)) {
        const [, marks, title] = line.match(HEADING);
        const heading = el(`h${Math.min(6, marks.length + 2)}`);
        inline(title, heading);
        out.append(heading);
        i += 1;
      } else if (ITEM.test(line)) {
        const ordered = /^\s*\d/.test(line);
        const list = el(ordered ? "ol" : "ul");
        if (ordered && parseInt(line, 10) !== 1) list.start = parseInt(line, 10);
        for (; i < lines.length && ITEM.test(lines[i]) && /^\s*\d/.test(lines[i]) === ordered; i += 1) {
          const item = el("li");
          inline(lines[i].replace(ITEM, ""), item);
          list.append(item);
        }
        out.append(list);
      } else if (QUOTE.test(line)) {
        const quote = el("blockquote");
        for (; i < lines.length && QUOTE.test(lines[i]); i += 1) {
          if (quote.childNodes.length) quote.append(el("br"));
          inline(lines[i].replace(QUOTE, ""), quote);
        }
        out.append(quote);
      } else {
        const p = el("p");
        for (; i < lines.length && plain(lines[i]); i += 1) {
          if (p.childNodes.length) p.append(el("br"));
          inline(lines[i], p);
        }
        out.append(p);
      }
    }
    return out;
  }

  // ----------------------------------------------------------------- API

  const auth = (extra = {}) => (key ? { ...extra, Authorization: `Bearer ${key}` } : extra);

  async function failure(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      message = (await response.json()).error.message;
    } catch {
      // not the gateway's error object: the status says it
    }
    const error = new Error(message);
    error.status = response.status;
    return error;
  }

  async function api(path, body) {
    const init = body === undefined ? { headers: auth() }
      : { method: "POST", headers: auth({ "Content-Type": "application/json" }), body: JSON.stringify(body) };
    const response = await fetch(path, init);
    if (response.status === 401) askKey();
    if (!response.ok) throw await failure(response);
    return response.json();
  }

  const bytes = (n) => {
    if (!n) return "0 B";
    const unit = Math.min(4, Math.floor(Math.log(n) / Math.log(1024)));
    return `${(n / 1024 ** unit).toFixed(unit ? 1 : 0)} ${["B", "KB", "MB", "GB", "TB"][unit]}`;
  };
  const count = (n) => (n ?? 0).toLocaleString();
  const duration = (s) => (s < 3600 ? `${Math.floor(s / 60)} min` : s < 172800 ? `${(s / 3600).toFixed(1)} h` : `${Math.floor(s / 86400)} d`);

  // ---------------------------------------------------------------- keys

  function askKey() {
    $("key-button").hidden = false;
    const dialog = $("key-dialog");
    if (!dialog.open) {
      $("key-input").value = key;
      dialog.showModal();
    }
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    key = $("key-input").value.trim();
    keep("key", key);
    $("key-dialog").close();
    refreshSessions();
    if (!$("view-dashboard").hidden) pollDashboard();
  });
  $("key-button").addEventListener("click", askKey);
  $("key-button").hidden = !key;

  // -------------------------------------------------------------- render

  function status(text, error = false) {
    $("status").textContent = text;
    $("status").classList.toggle("error", error);
  }

  function renderList() {
    const list = $("conversation-list");
    list.replaceChildren();
    for (const conv of conversations) {
      const item = el("li");
      const open = el("button");
      open.type = "button";
      open.className = "open";
      open.setAttribute("aria-current", String(conv.id === activeId));
      open.append(el("span", conv.title || "New chat"));
      open.firstChild.className = "title";
      const summary = summaries.get(conv.session);
      const meta = conv.session
        ? `${conv.session.slice(0, 8)} · ${summary ? `${summary.state} · ${count(summary.history_tokens)} tokens` : "…"}`
        : "no session yet";
      open.append(el("span", meta));
      open.lastChild.className = "meta";
      open.addEventListener("click", () => activate(conv.id));
      const forget = el("button", "×");
      forget.type = "button";
      forget.className = "forget";
      forget.title = `Forget “${conv.title || "New chat"}” in this browser (its session expires by the daemon's rules)`;
      forget.setAttribute("aria-label", forget.title);
      forget.addEventListener("click", () => forgetConversation(conv.id));
      item.append(open, forget);
      list.append(item);
    }
  }

  function renderSessionLine(info) {
    const conv = active();
    const line = $("session-line");
    line.replaceChildren();
    if (!conv?.session) {
      line.append("A new chat: its durable session opens with the first message.");
      return;
    }
    line.append("Session ");
    const id = el("code", conv.session);
    id.id = "session-id";
    line.append(id);
    if (info?.missing) {
      line.append(" · not found (expired or closed): the next message carries the chat into a new session");
    } else if (info) {
      line.append(
        ` · ${info.state} · ${count(info.history_tokens)} history tokens · KV ${bytes(info.kv_live_bytes)}` +
          (info.truncated_tokens ? ` · ${count(info.truncated_tokens)} tokens left the window` : ""),
      );
    }
  }

  function messageView(message) {
    const item = el("li");
    item.className = `message ${message.role}`;
    item.append(el("div", message.role === "user" ? "You" : "Model"));
    item.firstChild.className = "who";
    const body = el("div");
    body.className = "body";
    item.append(body);
    const foot = el("div");
    foot.className = "foot";
    item.append(foot);
    paint(item, message);
    return item;
  }

  function paint(item, message) {
    const body = item.querySelector(".body");
    if (message.role === "user") body.textContent = message.content;
    else body.replaceChildren(markdown(message.content));
    const notes = [];
    if (message.tokens) notes.push(`${message.tokens} tokens`);
    if (message.stopped) notes.push("stopped");
    if (message.finish === "length") notes.push("cut at max tokens");
    if (message.error) notes.push(message.error);
    item.querySelector(".foot").textContent = notes.join(" · ");
  }

  function renderMessages() {
    const conv = active();
    $("messages").replaceChildren(...(conv ? conv.messages.map(messageView) : []));
    $("messages").scrollTop = $("messages").scrollHeight;
  }

  function renderSettings() {
    const conv = active();
    for (const name of ["system", "temperature", "top_p", "max_tokens"]) $(name).value = conv[name];
    $("system").readOnly = Boolean(conv.session); // the session holds it since the first turn
    $("model").value = conv.model ?? DEFAULTS.model;
    $("model").disabled = Boolean(conv.session); // and runs on its model
  }

  function renderButtons() {
    const conv = active();
    $("send").disabled = Boolean(running);
    $("stop").disabled = !running;
    $("regenerate").disabled = Boolean(running) || !conv.messages.some((m) => m.role === "user");
  }

  function render() {
    renderList();
    renderSessionLine();
    renderSettings();
    renderMessages();
    renderButtons();
  }

  function activate(id) {
    if (running) return;
    activeId = id;
    save();
    render();
    status("");
    refreshInfo();
    $("prompt").focus();
  }

  function forgetConversation(id) {
    if (running?.conv.id === id) return;
    conversations = conversations.filter((c) => c.id !== id);
    if (activeId === id) activeId = conversations[0]?.id ?? newConversation().id;
    save();
    render();
    refreshInfo();
  }

  // ------------------------------------------------------------ sessions

  async function refreshSessions() {
    try {
      const { data } = await api("/v1/kvmux/sessions");
      summaries.clear();
      for (const summary of data) summaries.set(summary.session_id, summary);
      renderList();
      refreshInfo();
    } catch (error) {
      status(`Sessions: ${error.message}`, true);
    }
  }

  async function refreshInfo() {
    const conv = active();
    if (!conv?.session) return renderSessionLine();
    try {
      renderSessionLine(await api(`/v1/kvmux/sessions/${encodeURIComponent(conv.session)}`));
    } catch (error) {
      renderSessionLine(error.status === 404 ? { missing: true } : undefined);
    }
  }

  // ---------------------------------------------------------------- chat

  const wire = (m) => ({ role: m.role, content: m.content });

  // The whole conversation, for a chat without a session (or a regenerated reply).
  function history(conv) {
    const messages = conv.messages.map(wire);
    return conv.system ? [{ role: "system", content: conv.system }, ...messages] : messages;
  }

  // What the session still lacks: the messages after the last reply.
  function unsent(conv) {
    const last = conv.messages.map((m) => m.role).lastIndexOf("assistant");
    return conv.messages.slice(last + 1).map(wire);
  }

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  async function post(conv, messages, pinned, signal) {
    const body = {
      model: conv.model ?? DEFAULTS.model,
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number(conv.temperature),
      top_p: Number(conv.top_p),
      max_tokens: Number(conv.max_tokens),
    };
    const headers = auth({ "Content-Type": "application/json" });
    if (pinned) headers[SESSION] = pinned;
    for (let attempt = 0; ; attempt += 1) {
      const response = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(body), signal });
      // busy: the session is still winding down a reply that was just stopped
      if (response.status !== 409 || attempt === 20) return response;
      await sleep(250);
    }
  }

  // Server-sent events: each `data:` line's JSON, until [DONE].
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          if (line === "data: [DONE]") return;
          const event = JSON.parse(line.slice(6));
          if (event.error) throw new Error(event.error.message);
          yield event;
        }
      }
    }
  }

  // `prepare`: run first, once the reply is under way (stop works); false
  // sends the whole conversation without the session.
  async function complete(conv, prepare = async () => true) {
    const whole = history(conv);
    const rest = unsent(conv);
    const reply = { role: "assistant", content: "" };
    conv.messages.push(reply);
    save();
    const item = messageView(reply);
    item.classList.add("pending");
    $("messages").append(item);
    const controller = new AbortController();
    running = { controller, conv };
    renderButtons();
    status("Waiting for the first token…");
    let gone = false; // the pinned session expired or was closed
    try {
      const pinned = (await prepare()) ? conv.session : null;
      const response = await post(conv, pinned ? rest : whole, pinned, controller.signal);
      gone = response.status === 404 && Boolean(pinned);
      if (!gone) await stream(conv, reply, item, response);
    } catch (error) {
      if (error.name === "AbortError") {
        reply.stopped = true;
        status("Stopped. The session keeps what was said.");
      } else {
        reply.error = error.message;
        status(error.message, true);
      }
    } finally {
      running = null;
      if (gone || (!reply.content && reply.error)) conv.messages.splice(conv.messages.indexOf(reply), 1);
      save();
      item.classList.remove("pending");
      if (gone) item.remove();
      else paint(item, reply);
      renderButtons();
    }
    if (gone) {
      status("That chat's session was gone: a new session takes the whole conversation.");
      conv.session = null;
      return complete(conv, async () => false);
    }
    refreshSessions();
  }

  async function stream(conv, reply, item, response) {
    if (response.status === 401) askKey();
    if (!response.ok) throw await failure(response);
    conv.session = response.headers.get(SESSION) || conv.session;
    save();
    renderSessionLine();
    renderSettings();
    status("Replying… (Escape stops)");
    let frame = 0;
    try {
      for await (const event of events(response)) {
        const delta = event.choices?.[0]?.delta?.content;
        if (delta) {
          reply.content += delta;
          frame ||= requestAnimationFrame(() => {
            frame = 0;
            paint(item, reply);
            $("messages").scrollTop = $("messages").scrollHeight;
          });
        }
        if (event.choices?.[0]?.finish_reason) reply.finish = event.choices[0].finish_reason;
        if (event.usage) reply.tokens = event.usage.completion_tokens;
      }
    } finally {
      cancelAnimationFrame(frame);
    }
    status("");
  }

  function send() {
    const text = $("prompt").value.trim();
    if (!text || running) return;
    const conv = active();
    conv.messages.push({ role: "user", content: text });
    conv.title ||= text.slice(0, 60);
    $("prompt").value = "";
    renderMessages();
    renderList();
    complete(conv);
  }

  // The session goes back to before the last message (a rewind: its slab
  // keeps the rest), which is sent again. Where it cannot (no turn ends
  // there: the first message went in with the system prompt; or the
  // session is gone), the whole conversation goes without the session header.
  function regenerate() {
    const conv = active();
    if (running || !conv.messages.some((m) => m.role === "user")) return;
    while (conv.messages.at(-1)?.role === "assistant") conv.messages.pop();
    renderMessages();
    const kept = conv.messages.map((m) => m.role).lastIndexOf("assistant") + 1 + (conv.system ? 1 : 0);
    complete(conv, async () => {
      if (!conv.session) return false;
      try {
        await api(`/v1/kvmux/sessions/${encodeURIComponent(conv.session)}/rewind`, { messages: kept });
        return true;
      } catch {
        return false;
      }
    });
  }

  const stop = () => running?.controller.abort();

  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && running && !$("key-dialog").open) stop();
  });
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", () => {
    if (running) return;
    const empty = conversations.find((c) => !c.messages.length);
    activate(empty ? empty.id : newConversation().id);
  });
  $("model").addEventListener("change", () => {
    active().model = $("model").value;
    save();
  });
  for (const name of ["system", "temperature", "top_p", "max_tokens"]) {
    $(name).addEventListener("input", () => {
      const conv = active();
      conv[name] = name === "system" ? $(name).value : Number($(name).value);
      keep("settings", { temperature: conv.temperature, top_p: conv.top_p, max_tokens: conv.max_tokens });
      save();
    });
  }

  // ----------------------------------------------------------- dashboard

  let dashTimer = null;

  function showView(name) {
    for (const view of ["chat", "dashboard"]) {
      $(`view-${view}`).hidden = view !== name;
      $(`tab-${view}`).setAttribute("aria-selected", String(view === name));
    }
    clearInterval(dashTimer);
    if (name === "dashboard") {
      pollDashboard();
      dashTimer = setInterval(pollDashboard, 2000);
    }
  }
  $("tab-chat").addEventListener("click", () => showView("chat"));
  $("tab-dashboard").addEventListener("click", () => showView("dashboard"));

  async function pollDashboard() {
    try {
      renderDashboard(await api("/v1/kvmux/stats"));
      $("dash-status").textContent = `Updated ${new Date().toLocaleTimeString()}`;
    } catch (error) {
      $("dash-status").textContent = `Stats unavailable: ${error.message}`;
    }
  }

  function card(stat, value, label) {
    const box = el("div");
    box.className = "card";
    box.dataset.stat = stat;
    box.append(el("span", String(value)), el("span", label));
    box.firstChild.className = "value";
    box.lastChild.className = "label";
    return box;
  }

  // The model picker: the daemon's default, then each model it serves (GET /v1/models).
  function renderModels(models) {
    const chosen = $("model").value;
    const options = [el("option", "the daemon's default"), ...models.map((m) => el("option", `${m.id} (${m.state})`))];
    options[0].value = DEFAULTS.model;
    models.forEach((m, n) => (options[n + 1].value = m.id));
    $("model").replaceChildren(...options);
    $("model").value = chosen || DEFAULTS.model;
  }

  async function refreshModels() {
    try {
      renderModels((await api("/v1/models")).data);
    } catch {
      // the picker keeps the default; the chat says what went wrong when it is used
    }
  }

  function renderDashboard({ broker, gateway, workers_gone }) {
    const refused = broker.refused.reduce((sum, r) => sum + r.count, 0);
    const prefixes = broker.workers.reduce(
      (sum, w) => ({ hits: sum.hits + (w.prefixes?.hits ?? 0), misses: sum.misses + (w.prefixes?.misses ?? 0), bytes: sum.bytes + (w.prefixes?.bytes ?? 0) }),
      { hits: 0, misses: 0, bytes: 0 },
    );
    $("cards").replaceChildren(
      card("workers", broker.workers.length, `workers${workers_gone ? ` (${workers_gone} gone since the gateway started)` : ""}`),
      card("slabs", `${broker.slabs_used} / ${broker.slabs_total}`, "slabs used / total"),
      card("sessions", count(broker.sessions), "sessions"),
      card("live", count(broker.sessions_live), "live (in a slab)"),
      card("hibernated", count(broker.sessions_hibernated), "hibernated (in the store)"),
      card("in-flight", count(broker.in_flight), "requests in flight"),
      card("queue", count(broker.queue_depth), `queued · wait p50 ${broker.queue_wait_p50_s.toFixed(2)} s, p99 ${broker.queue_wait_p99_s.toFixed(2)} s`),
      card("refused", count(refused), `refused of ${count(broker.admitted + refused)} asked`),
      card("restores", count(broker.restores), `restores · p50 ${(broker.restore_p50_s * 1000).toFixed(0)} ms`),
      card("store", bytes(broker.store_bytes), "in the session store"),
      card("prefixes", `${count(prefixes.hits)} / ${count(prefixes.hits + prefixes.misses)}`, `shared prefix hits / new openings · ${bytes(prefixes.bytes)} held`),
      card("uptime", duration(broker.uptime_s), broker.draining ? "broker up · draining" : "broker up"),
    );
    const rows = broker.workers.map((w) => {
      const row = el("tr");
      const compute = w.compute ? `${w.compute.device}${w.compute.kernel ? ` · ${w.compute.kernel}` : ""} · ${w.compute.blas || "BLAS ?"} · ${w.compute.mode}${w.compute.exact ? " · exact" : ""}` : "";
      const accepted = w.drafted ? `${((100 * w.accepted) / w.drafted).toFixed(0)} % of ${count(w.drafted)}` : "–";
      const cells = [
        `${w.worker_id.slice(0, 8)} (${w.host}, pid ${w.pid})`,
        w.model,
        `${w.slabs_used} / ${w.slabs_total - w.slabs_used}`,
        String(w.running),
        compute,
        accepted,
        `${w.last_seen_s.toFixed(1)} s ago`,
      ];
      row.append(...cells.map((text) => el("td", text)));
      return row;
    });
    $("workers").tBodies[0].replaceChildren(...rows);
    const budget = broker.max_resident_bytes ? `budget ${bytes(broker.max_resident_bytes)} · ` : "";
    $("models-line").textContent = `${budget}${count(broker.model_loads)} loads, ${count(broker.model_unloads)} unloads`;
    $("models").tBodies[0].replaceChildren(...broker.models.map((m) => {
      const row = el("tr");
      const marks = [m.default ? "default" : "", m.pinned ? "pinned" : ""].filter(Boolean).join(", ");
      const cells = [m.model + (marks ? ` (${marks})` : ""), m.state, m.aliases.join(", ") || "–", String(m.workers),
        m.resident_bytes ? bytes(m.resident_bytes) : "–", m.idle_s ? `${m.idle_s.toFixed(0)} s` : "–"];
      row.append(...cells.map((text) => el("td", text)));
      return row;
    }));
    const reasons = broker.refused.filter((r) => r.count);
    $("refusals").replaceChildren(...(reasons.length ? reasons.map((r) => el("li", `${r.reason}: ${count(r.count)}`)) : [el("li", "none")]));
    plot($("plot-tok"), gateway.decode_tok_s, gateway.window_s, "tok/s");
    plot($("plot-ttft"), gateway.ttft_s, gateway.window_s, "s");
  }

  // Points [seconds ago, value] on a canvas: now at the right edge.
  function plot(canvas, points, windowS, unit) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    canvas.width = width * ratio;
    canvas.height = height * ratio;
    const g = canvas.getContext("2d");
    g.scale(ratio, ratio);
    const style = getComputedStyle(document.documentElement);
    const ink = style.getPropertyValue("--muted");
    const accent = style.getPropertyValue("--accent");
    const pad = { left: 44, right: 8, top: 10, bottom: 18 };
    const top = Math.max(...points.map((p) => p[1]), 0) * 1.15 || 1;
    const x = (age) => pad.left + (1 - age / windowS) * (width - pad.left - pad.right);
    const y = (value) => height - pad.bottom - (value / top) * (height - pad.top - pad.bottom);
    g.clearRect(0, 0, width, height);
    g.strokeStyle = g.fillStyle = ink;
    g.font = "11px system-ui, sans-serif";
    g.beginPath();
    g.moveTo(pad.left, pad.top);
    g.lineTo(pad.left, height - pad.bottom);
    g.lineTo(width - pad.right, height - pad.bottom);
    g.stroke();
    g.fillText(top < 10 ? top.toFixed(2) : top.toFixed(0), 4, pad.top + 8);
    g.fillText("0", 4, height - pad.bottom);
    g.fillText(`-${Math.round(windowS / 60)} min`, pad.left, height - 4);
    g.fillText("now", width - pad.right - 22, height - 4);
    if (!points.length) {
      g.fillText("no streamed replies yet", pad.left + 10, pad.top + 24);
      canvas.setAttribute("aria-label", "No streamed replies yet");
      return;
    }
    const ordered = [...points].sort((a, b) => b[0] - a[0]);
    g.strokeStyle = g.fillStyle = accent;
    g.lineWidth = 1.5;
    g.beginPath();
    ordered.forEach(([age, value], n) => (n ? g.lineTo(x(age), y(value)) : g.moveTo(x(age), y(value))));
    g.stroke();
    for (const [age, value] of ordered) {
      g.beginPath();
      g.arc(x(age), y(value), 2.5, 0, 2 * Math.PI);
      g.fill();
    }
    const values = ordered.map((p) => p[1]).sort((a, b) => a - b);
    const last = ordered.at(-1)[1];
    canvas.setAttribute("aria-label", `${points.length} replies; last ${last.toFixed(2)} ${unit}, median ${values[values.length >> 1].toFixed(2)} ${unit}`);
  }

  // ---------------------------------------------------------------- start

  if (!active()) activeId = conversations[0]?.id ?? newConversation().id;
  render();
  refreshSessions();
  refreshModels();
})();
