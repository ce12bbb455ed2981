// OpGuard report.html: icicle graphs and tables, built from the embedded JSON.
// Part of OpGuard (Apache-2.0); no third-party code. Every text goes through
// textContent, never innerHTML, so no input can inject markup or script.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("opguard-data").textContent);
  const tip = document.createElement("div");
  tip.className = "tip";
  document.body.appendChild(tip);

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function section(title, parent) {
    const s = el("section");
    s.appendChild(el("h2", title));
    (parent || document.getElementById("content")).appendChild(s);
    return s;
  }
  function hue(name) {
    let h = 0;
    for (let i = 0; i < name.length; i++) h = (h * 31 + name.charCodeAt(i)) >>> 0;
    return h;
  }
  function color(node) {
    const h = hue(node.n);
    if (node.k === "torch_api") return "hsl(" + (200 + (h % 40)) + ",60%,70%)";
    return "hsl(" + (10 + (h % 45)) + ",75%," + (62 + (h % 15)) + "%)";
  }

  // ------------------------------------------------------------ icicle graph
  function icicle(container, root) {
    const box = el("div", null, "flame");
    box.setAttribute("data-role", "flame");
    const crumb = el("div", "click a frame to zoom, click the top row to zoom out");
    container.appendChild(crumb);
    container.appendChild(box);
    const parents = new Map();
    // explicit stacks, never recursion per level: a tree may be thousands of levels deep
    for (const todo = [root]; todo.length;) {
      const node = todo.pop();
      for (const c of node.ch) { parents.set(c, node); todo.push(c); }
    }
    function depthOf(top) {
      let most = 0;
      for (const todo = [[top, 1]]; todo.length;) {
        const [node, d] = todo.pop();
        most = Math.max(most, d);
        for (const c of node.ch) todo.push([c, d + 1]);
      }
      return most;
    }
    const rowH = 17;
    function draw(focus) {
      box.replaceChildren();
      const ancestors = [];
      for (let p = focus; p; p = parents.get(p)) ancestors.unshift(p);
      const rowsN = ancestors.length - 1 + depthOf(focus);
      box.style.height = rowsN * rowH + "px";
      ancestors.forEach(function (node, depth) { bar(node, depth, 0, 100, focus); });
      const depth0 = ancestors.length - 1;
      for (const todo = [[focus, depth0, 0, 100]]; todo.length;) {
        const [node, depth, left, width] = todo.pop();
        if (node !== focus) bar(node, depth, left, width, focus);
        let x = left;
        const next = [];
        for (const c of node.ch) {
          const w = node.c ? (width * c.c) / node.c : 0;
          if (w > 0.05) next.push([c, depth + 1, x, w]);
          x += w;
        }
        for (let i = next.length - 1; i >= 0; i--) todo.push(next[i]);  // drawn in order
      }
    }
    function bar(node, depth, left, width, focus) {
      const d = el("div", width > 3 ? node.n : "", "bar");
      d.style.left = left + "%";
      d.style.width = width + "%";
      d.style.top = depth * rowH + "px";
      d.style.background = node === root ? "#ddd" : color(node);
      d.addEventListener("click", function () { draw(node === focus ? (parents.get(node) || root) : node); });
      d.addEventListener("mousemove", function (ev) {
        const ops = Object.entries(node.o).sort(function (a, b) { return b[1] - a[1]; });
        const lines = [node.n, node.c + " ops (" + ((100 * node.c) / root.c).toFixed(1) + "% of all)"];
        if (node.k) lines.push("kind: " + node.k);
        if (ops.length) lines.push("own ops:");
        for (const [op, n] of ops.slice(0, 12)) lines.push("  " + op + ": " + n);
        if (ops.length > 12) lines.push("  … " + (ops.length - 12) + " more");
        tip.textContent = lines.join("\n");
        tip.style.display = "block";
        tip.style.left = Math.min(ev.clientX + 12, window.innerWidth - 300) + "px";
        tip.style.top = ev.clientY + 14 + "px";
      });
      d.addEventListener("mouseleave", function () { tip.style.display = "none"; });
      box.appendChild(d);
    }
    draw(root);
  }

  // ------------------------------------------------------------ sortable table
  function table(container, columns, rows, searchable, role) {
    const input = el("input", null, "search");
    input.type = "search";
    input.placeholder = "search…";
    if (searchable) container.appendChild(input);
    const t = el("table");
    t.setAttribute("data-role", role || "table");
    const head = el("tr");
    const body = el("tbody");
    let key = -1, asc = true;
    columns.forEach(function (col, i) {
      const th = el("th", col.title, col.num ? "num" : "");
      th.addEventListener("click", function () { asc = key === i ? !asc : true; key = i; fill(); });
      head.appendChild(th);
    });
    const thead = el("thead"); thead.appendChild(head);
    if (columns.some(function (c) { return c.title; })) t.appendChild(thead);
    t.appendChild(body);
    container.appendChild(t);
    function fill() {
      const q = input.value.toLowerCase();
      let shown = rows.filter(function (r) { return !q || r.join(" ").toLowerCase().includes(q); });
      if (key >= 0) {
        shown = shown.slice().sort(function (a, b) {
          const x = a[key], y = b[key];
          const c = columns[key].num ? x - y : String(x).localeCompare(String(y));
          return asc ? c : -c;
        });
      }
      body.replaceChildren();
      for (const r of shown) {
        const tr = el("tr");
        r.forEach(function (v, i) {
          const td = el("td", v, columns[i].num ? "num" : (columns[i].cls ? columns[i].cls(v) : ""));
          tr.appendChild(td);
        });
        body.appendChild(tr);
      }
    }
    input.addEventListener("input", fill);
    fill();
  }

  // ------------------------------------------------------------ the page
  const s = data.summary || {};
  const top = el("div", null, "side-by-side");
  document.getElementById("content").appendChild(top);
  const run = section("Run", top);
  const facts = [["status", s.status], ["exit code", s.exit_code], ["started", s.started_at],
    ["seconds", s.seconds], ["inputs", (s.inputs || []).join(" ")], ["opguard", s.opguard_version]];
  table(run, [{ title: "" }, { title: "" }], facts.map(function (f) { return [f[0], f[1] === undefined ? "" : f[1]]; }), false);
  const stages = section("Stages", top);
  table(stages, [{ title: "stage" }, { title: "entry" },
    { title: "status", cls: function (v) { return "status-" + v; } }, { title: "plugin" },
    { title: "seconds", num: true }, { title: "error" }],
    (s.stages || []).map(function (r) { return [r.stage, r.entry || "", r.status, r.plugin || "", r.seconds, r.error || ""]; }), false);

  for (const entry of data.entries) {
    const sec = section("Entry " + entry.index + ": " + entry.name);
    sec.id = "entry-" + Number(entry.index);
    if (entry.tree) {
      sec.appendChild(el("h3", "Call tree (" + entry.tree.c + " ops)"));
      icicle(sec, entry.tree);
    }
    if (entry.findings && entry.findings.length) {
      sec.appendChild(el("h3", "Divergence findings (" + entry.findings.length + ")"));
      table(sec, [{ title: "severity", cls: function (v) { return "sev-" + v; } }, { title: "kind" },
        { title: "target" }, { title: "op" }, { title: "ranks" }, { title: "message" }], entry.findings, true, "findings");
    }
    if (entry.config_note) sec.appendChild(el("p", entry.config_note));
    if (entry.config) {
      sec.appendChild(el("h3", "Instrumentation config (" + entry.config.length + " entries)"));
      table(sec, [{ title: "target" }, { title: "kind" }, { title: "context" }, { title: "tags" },
        { title: "ops" }, { title: "count", num: true }, { title: "ranks", num: true }], entry.config, true, "config");
    }
  }
  if (data.comparisons.length) {
    const sec = section("Comparisons");
    for (const c of data.comparisons) {
      sec.appendChild(el("h3", c.name));
      sec.appendChild(el("pre", c.text));
    }
  }
  // deep links (report.html#entry-2): the sections exist only now, so scroll here
  const target = location.hash ? document.getElementById(location.hash.slice(1)) : null;
  if (target) target.scrollIntoView();
  document.body.setAttribute("data-ready", "1");
})();
