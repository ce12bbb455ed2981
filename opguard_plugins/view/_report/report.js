// OpGuard report.html: tables, an icicle graph and a picture of the ranks, built
// from the embedded JSON (shaped by opguard_plugins/report.py). Part of OpGuard
// (Apache-2.0); no third-party code. Every text goes through textContent, an
// attribute or a canvas, never innerHTML, so no input can inject markup or script.
"use strict";
(function () {
  // Control, line-separator and bidi-override characters a trace's names may carry,
  // shown as \uXXXX (as the terminal commands escape them: errors.one_line), so a
  // name cannot reverse or hide the text after it; tabs and newlines stay.
  const HIDDEN = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]/g;
  function printable(text) {
    return String(text).replace(HIDDEN, function (c) { return "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0"); });
  }
  const data = JSON.parse(document.getElementById("opguard-data").textContent);
  const content = document.getElementById("content");
  const header = document.getElementById("top");
  const tip = el("div", null, "tip");
  document.body.appendChild(tip);

  // ------------------------------------------------------------ small helpers
  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = printable(text);
    if (cls) e.className = cls;
    return e;
  }
  function add(parent, tag, text, cls) { return parent.appendChild(el(tag, text, cls)); }
  const numbers = new Intl.NumberFormat("en-US", { maximumFractionDigits: 20 });
  function num(n) { return typeof n === "number" ? numbers.format(n) : (n === undefined || n === null ? "" : String(n)); }
  function short(n) {
    if (typeof n !== "number") return String(n);
    const a = Math.abs(n);
    if (a >= 1e9) return (n / 1e9).toFixed(a >= 1e10 ? 0 : 1) + "G";
    if (a >= 1e6) return (n / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
    if (a >= 1e4) return (n / 1e3).toFixed(a >= 1e5 ? 0 : 1) + "k";
    return String(n);
  }
  // "1 entry", "2 entries", "3 matches": English plurals of the words the report counts
  function plural(n, word) {
    if (n === 1) return num(n) + " " + word;
    if (/[^aeiou]y$/.test(word)) return num(n) + " " + word.slice(0, -1) + "ies";
    return num(n) + " " + word + (/(s|x|ch|sh)$/.test(word) ? "es" : "s");
  }
  // "0-3,7" -> [0, 1, 2, 3, 7]
  function parseRanges(text) {
    const out = [];
    if (!text) return out;
    for (const part of String(text).split(",")) {
      const dash = part.indexOf("-", 1);
      const a = parseInt(dash > 0 ? part.slice(0, dash) : part, 10);
      const b = dash > 0 ? parseInt(part.slice(dash + 1), 10) : a;
      for (let r = a; r <= b; r++) out.push(r);
    }
    return out;
  }
  function showTip(ev, text) {
    tip.textContent = printable(text);
    tip.style.display = "block";
    tip.style.left = Math.max(0, Math.min(ev.clientX + 12, window.innerWidth - 330)) + "px";
    tip.style.top = Math.min(ev.clientY + 14, window.innerHeight - 40) + "px";
  }
  function hideTip() { tip.style.display = "none"; }
  function section(title, id) {
    const s = add(content, "section");
    if (id) s.id = id;
    add(s, "h2", title);
    return s;
  }
  // a <details> whose body is built the first time it opens
  function lazyDetails(parent, title, build, open) {
    const d = add(parent, "details");
    add(d, "summary", title);
    let built = false;
    function ensure() { if (!built) { built = true; build(d); } }
    d.addEventListener("toggle", function () { if (d.open) ensure(); });
    if (open) { d.open = true; ensure(); }
    return d;
  }

  // ------------------------------------------------------------ search, one box for the page
  const searchers = [];
  let query = "";
  function onSearch(fn) { searchers.push(fn); if (query) fn(query); }
  const searchBox = el("input", null, "search");
  searchBox.type = "search";
  searchBox.placeholder = "search functions, ops, tags, ranks…";
  searchBox.setAttribute("data-role", "search");
  const hitsNote = el("span", "", "hits");
  searchBox.addEventListener("input", function () {
    query = searchBox.value.trim().toLowerCase();
    let hits = 0;
    for (const fn of searchers) hits += fn(query) || 0;
    hitsNote.textContent = query ? plural(hits, "match") + " (tables and graphs)" : "";
  });

  // ------------------------------------------------------------ paged, sortable table
  // columns: {title, width, num, text(row), sort(row), cls(row)}; rows: any values;
  // haystack(row): the text a search looks in; detail(row): the element shown when a
  // row is opened. Only one page of rows is ever in the DOM.
  function pagedTable(container, opts) {
    const columns = opts.columns;
    const pageSize = opts.pageSize || 50;
    const t = el("table", null, "grid");
    t.setAttribute("data-role", opts.role);
    const colgroup = add(t, "colgroup");
    for (const c of columns) add(colgroup, "col").style.width = c.width;
    const head = add(add(t, "thead"), "tr");
    const body = add(t, "tbody");
    const pager = el("div", null, "pager");
    const prev = el("button", "‹ prev"), next = el("button", "next ›"), where = el("span");
    pager.append(where, prev, next);
    container.append(t, pager);
    let key = opts.sortColumn === undefined ? -1 : opts.sortColumn, asc = false;
    let page = 0, shown = opts.rows.map(function (_, i) { return i; });
    const open = new Set();
    let hay = null;
    columns.forEach(function (col, i) {
      const th = add(head, "th", col.title, col.num ? "num" : "");
      th.addEventListener("click", function () {
        asc = key === i ? !asc : !col.num;
        key = i;
        order();
        page = 0;
        fill();
      });
    });
    function value(i, k) { const c = columns[k]; return (c.sort || c.text)(opts.rows[i]); }
    function order() {
      if (key < 0) return;
      const c = columns[key];
      shown.sort(function (a, b) {
        const x = value(a, key), y = value(b, key);
        const d = c.num ? x - y : String(x).localeCompare(String(y));
        return (asc ? d : -d) || a - b;
      });
      head.childNodes.forEach(function (th, i) {
        th.classList.toggle("sorted", i === key);
        th.classList.toggle("asc", i === key && asc);
      });
    }
    function fill() {
      const pages = Math.max(1, Math.ceil(shown.length / pageSize));
      page = Math.min(page, pages - 1);
      body.replaceChildren();
      const start = page * pageSize;
      for (const i of shown.slice(start, start + pageSize)) {
        const row = opts.rows[i];
        const tr = add(body, "tr", null, "row");
        tr.setAttribute("data-row", i);
        for (const c of columns) {
          const text = c.text(row);
          const td = add(tr, "td", text, (c.num ? "num " : "") + (c.cls ? c.cls(row) : ""));
          if (!c.num && String(text).length > 12) td.title = printable(text);
        }
        if (opts.detail) {
          tr.addEventListener("click", function () { toggle(i, tr); });
          if (open.has(i)) showDetail(i, tr);
        }
      }
      const total = opts.rows.length;
      where.textContent = (shown.length ? num(start + 1) + "–" + num(Math.min(start + pageSize, shown.length)) : "0") +
        " of " + num(shown.length) + (shown.length < total ? " (of " + num(total) + ")" : "") +
        (opts.more ? " · " + opts.more : "");
      prev.disabled = page === 0;
      next.disabled = page >= pages - 1;
      pager.style.display = total > pageSize || opts.more || shown.length < total ? "" : "none";
    }
    function showDetail(i, tr) {
      tr.classList.add("open");
      const d = el("tr", null, "detail");
      const td = add(d, "td");
      td.colSpan = columns.length;
      td.appendChild(opts.detail(opts.rows[i]));
      tr.after(d);
    }
    function toggle(i, tr) {
      if (open.has(i)) {
        open.delete(i);
        tr.classList.remove("open");
        if (tr.nextSibling && tr.nextSibling.classList.contains("detail")) tr.nextSibling.remove();
      } else {
        open.add(i);
        showDetail(i, tr);
      }
    }
    prev.addEventListener("click", function () { page--; fill(); });
    next.addEventListener("click", function () { page++; fill(); });
    order();
    fill();
    if (opts.haystack) {
      const haystacks = function () { if (!hay) hay = opts.rows.map(function (r) { return opts.haystack(r).toLowerCase(); }); };
      if (window.requestIdleCallback) window.requestIdleCallback(haystacks);  // ready before the first keystroke
      onSearch(function (q) {
        haystacks();
        const now = [];
        for (let i = 0; i < hay.length; i++) if (!q || hay[i].includes(q)) now.push(i);
        if (now.length !== shown.length || page || !sameSet(now, shown)) {
          shown = now;
          order();
          page = 0;
          fill();
        }
        return q ? shown.length : 0;
      });
    }
    return {
      // open row i (its page, its detail) and bring it into view
      reveal: function (i) {
        let at = shown.indexOf(i);
        if (at < 0) { searchBox.value = ""; searchBox.dispatchEvent(new Event("input")); at = shown.indexOf(i); }
        page = Math.floor(at / pageSize);
        open.add(i);
        fill();
        const tr = body.querySelector('tr[data-row="' + i + '"]');
        if (tr) tr.scrollIntoView({ block: "center" });
      },
    };
  }

  // whether two lists of row indices hold the same rows (``b`` may be sorted otherwise)
  function sameSet(a, b) {
    if (a.length !== b.length) return false;
    const seen = new Set(b);
    return a.every(function (i) { return seen.has(i); });
  }
  function detailGrid(pairs) {
    const g = el("div", null, "detail-grid");
    for (const [k, v] of pairs) {
      if (v === undefined || v === null || v === "") continue;
      add(g, "div", k);
      const cell = add(g, "div");
      if (v instanceof Node) cell.appendChild(v); else cell.textContent = printable(v);
    }
    return g;
  }
  function pairList(pairs, total) {
    const box = el("div", null, "pairs");
    for (const [name, n] of pairs) {
      add(box, "div", num(n) + "  " + name + (total ? "  (" + ((100 * n) / total).toFixed(1) + "%)" : ""));
    }
    return box;
  }

  // ------------------------------------------------------------ config tables
  // row: [target, kind, context, tags, count, ops, streams, ranks, file, lines, dtypes]
  // (ops: [index into cfg.names, count]; ranks: [count, ranges] or null for all)
  function rankSet(r) { return r[1] + " (" + num(r[0]) + ")"; }
  function configTable(container, name, cfg) {
    const total = cfg.total || 0;
    const opName = function (p) { return cfg.names[p[0]]; };
    const more = cfg.entries > cfg.rows.length ? "the largest " + num(cfg.rows.length) + " of " + num(cfg.entries) + " entries (all in " + name + ")" : "";
    add(container, "p", name + ": " + plural(cfg.entries, "entry") + ", " + plural(total, "op") +
      " over " + plural(cfg.ranks, "rank") + "; largest count first, click a row for its ops, streams and ranks.", "note");
    return pagedTable(container, {
      role: "config",
      rows: cfg.rows,
      pageSize: 30,
      more: more,
      sortColumn: 5,
      columns: [
        { title: "target", width: "27%", text: function (r) { return r[0]; } },
        { title: "kind", width: "7%", text: function (r) { return r[1]; } },
        { title: "context", width: "23%", text: function (r) { return r[2].join(" › "); } },
        { title: "tags", width: "13%", text: function (r) { return r[3].join(", "); } },
        { title: "ops", width: "12%", text: function (r) { return r[5].length ? opName(r[5][0]) + (r[5].length > 1 ? " +" + (r[5].length - 1) : "") : ""; } },
        { title: "count", width: "8%", num: true, text: function (r) { return num(r[4]); }, sort: function (r) { return r[4]; } },
        { title: "share", width: "5%", num: true, text: function (r) { return total ? ((100 * r[4]) / total).toFixed(1) + "%" : ""; }, sort: function (r) { return r[4]; } },
        { title: "ranks", width: "5%", num: true, text: function (r) { return r[7] === null ? "all" : num(r[7][0]); }, sort: function (r) { return r[7] === null ? cfg.ranks : r[7][0]; } },
      ],
      haystack: function (r) {
        return [r[0], r[1], r[2].join(" "), r[3].join(" "), r[5].map(opName).join(" "), r[8] || ""].join("\n");
      },
      detail: function (r) {
        return detailGrid([
          ["target", r[0]],
          ["file", r[8] ? r[8] + (r[9] ? " (lines " + r[9] + ")" : "") : ""],
          ["context", r[2].length ? r[2].join(" › ") : "(top level)"],
          ["tags", r[3].join(", ")],
          ["count", num(r[4]) + (total ? " (" + ((100 * r[4]) / total).toFixed(2) + "% of all ops)" : "")],
          ["ranks", r[7] === null ? "all " + num(cfg.ranks) : r[7][1] + " (" + num(r[7][0]) + " of " + num(cfg.ranks) + ")"],
          ["ops (" + r[5].length + ")", pairList(r[5].map(function (p) { return [opName(p), p[1]]; }), r[4])],
          ["streams", pairList(r[6].map(function (p) { return ["stream " + p[0], p[1]]; }), r[4])],
          ["dtypes", r[10] ? pairList(r[10], r[4]) : null],
        ]);
      },
    });
  }

  // ------------------------------------------------------------ icicle graph
  function icicle(container, flat) {
    const nodes = flat.n.map(function (n, i) {
      const own = flat.o[i].map(function (p) { return [flat.names[p[0]], p[1]]; });
      return { i: i, name: flat.names[n], kind: flat.k[i], c: flat.c[i], own: own, ranks: flat.r[String(i)] || null, ch: [], parent: null };
    });
    nodes.forEach(function (node, i) { if (flat.p[i] >= 0) { node.parent = nodes[flat.p[i]]; node.parent.ch.push(node); } });
    const root = nodes[0];
    const names = flat.names.map(function (s) { return s.toLowerCase(); });
    const crumbs = add(container, "div", null, "crumbs");
    const box = add(container, "div", null, "flame");
    box.setAttribute("data-role", "flame");
    if (flat.cut) add(container, "p", plural(flat.cut, "smaller frame") + " of the tree left out of the graph (the report keeps the largest " + num(nodes.length) + ").", "note");
    const rowH = 17, minPx = 5, charW = 6.7;
    let focus = root;
    let hit = null, holds = null;  // per node index, while searching
    let drawn = [];  // [bar, the nodes it stands for]
    const ownText = nodes.map(function (n) { return n.own.map(function (p) { return p[0]; }).join("\n").toLowerCase(); });
    function hue(name) {
      let h = 0;
      for (let i = 0; i < name.length; i++) h = (h * 31 + name.charCodeAt(i)) >>> 0;
      return h;
    }
    function color(node) {
      const h = hue(node.name);
      if (node.kind === "torch_api") return "hsl(" + (200 + (h % 40)) + ",60%,72%)";
      return "hsl(" + (10 + (h % 45)) + ",75%," + (62 + (h % 15)) + "%)";
    }
    function label(name, px) {
      const fit = Math.floor((px - 5) / charW);
      if (fit >= name.length) return name;
      const colon = name.indexOf(":");
      const q = colon >= 0 ? name.slice(colon + 1) : name;
      if (fit >= q.length) return q;
      return fit >= 4 ? q.slice(0, fit - 1) + "…" : "";
    }
    function tipText(node) {
      const lines = [node.name, plural(node.c, "op") + " (" + (root.c ? (100 * node.c) / root.c : 0).toFixed(1) + "% of all)"];
      if (node.kind) lines.push("kind: " + node.kind);
      if (node.ranks) lines.push("only on ranks " + node.ranks[1] + " (" + num(node.ranks[0]) + (flat.ranks ? " of " + num(flat.ranks) : "") + ")");
      if (node.own.length) lines.push("own ops:");
      for (const [op, n] of node.own.slice(0, 12)) lines.push("  " + op + ": " + num(n));
      if (node.own.length > 12) lines.push("  … " + (node.own.length - 12) + " more");
      return lines.join("\n");
    }
    function bar(node, depth, x, w, text, cls) {
      const d = add(box, "div", text, cls);
      d.style.left = x + "px";
      d.style.width = Math.max(w, 1) + "px";
      d.style.top = depth * rowH + "px";
      return d;
    }
    function draw() {
      const width = box.clientWidth || 1000;
      box.replaceChildren();
      drawn = [];
      const path = [];
      for (let p = focus; p; p = p.parent) path.unshift(p);
      let depthMax = 0;
      path.forEach(function (node, depth) {
        const d = bar(node, depth, 0, width, label(node.name, width), "");
        d.style.background = node === root ? "#ddd" : color(node);
        drawn.push([d, [node]]);
        d.addEventListener("click", function () { focus = node === focus ? (node.parent || root) : node; draw(); });
        d.addEventListener("mousemove", function (ev) { showTip(ev, tipText(node) + (node === focus && node !== root ? "\n(click: zoom out)" : "")); });
        d.addEventListener("mouseleave", hideTip);
        depthMax = depth;
      });
      const todo = [[focus, path.length - 1, 0, width]];
      while (todo.length) {
        const [node, depth, left, w] = todo.pop();
        let x = left, small = [], smallW = 0;
        const flush = function () {
          if (!small.length) return;
          if (smallW >= 1) {
            const group = small.slice();
            const d = bar(null, depth + 1, x - smallW, smallW, smallW > 26 ? "+" + group.length : "", "more");
            drawn.push([d, group]);
            const ops = group.reduce(function (s, n) { return s + n.c; }, 0);
            d.addEventListener("mousemove", function (ev) { showTip(ev, plural(group.length, "small frame") + " under " + node.name + ": " + plural(ops, "op") + "\n(click: zoom into " + node.name + ")"); });
            d.addEventListener("mouseleave", hideTip);
            d.addEventListener("click", function () { focus = node; draw(); });
            depthMax = Math.max(depthMax, depth + 1);
          }
          small = [];
          smallW = 0;
        };
        for (const c of node.ch) {
          const cw = node.c ? (w * c.c) / node.c : 0;
          if (cw < minPx) { small.push(c); smallW += cw; x += cw; continue; }
          flush();
          const d = bar(c, depth + 1, x, cw, label(c.name, cw), c.ranks ? "rankset" : "");
          d.style.background = color(c);
          drawn.push([d, [c]]);
          d.addEventListener("click", function () { focus = c; draw(); });
          d.addEventListener("mousemove", function (ev) { showTip(ev, tipText(c)); });
          d.addEventListener("mouseleave", hideTip);
          depthMax = Math.max(depthMax, depth + 1);
          todo.push([c, depth + 1, x, cw]);
          x += cw;
        }
        flush();
      }
      box.style.height = (depthMax + 1) * rowH + 2 + "px";
      crumbs.replaceChildren();
      add(crumbs, "span", "click a frame to zoom in, the top row to zoom out; purple underline: only on some ranks. ");
      path.forEach(function (node, i) {
        if (i) add(crumbs, "span", " › ");
        const a = add(crumbs, "a", node === root ? "all" : node.name);
        a.addEventListener("click", function () { focus = node; draw(); });
      });
      paint();
    }
    // search marks on the bars drawn: a frame that matches, one that holds a match
    // below it, a bar of small frames one of which holds a match
    function paint() {
      box.classList.toggle("searching", !!hit);
      for (const [d, group] of drawn) {
        const one = group.length === 1 && !d.classList.contains("more");
        const matches = !!hit && (one ? hit[group[0].i] === 1 : group.some(function (n) { return holds[n.i] === 1; }));
        d.classList.toggle("hit", matches);
        d.classList.toggle("holds-hit", !!hit && one && !matches && holds[group[0].i] === 1);
      }
    }
    onSearch(function (q) {
      let count = 0;
      if (q) {
        hit = new Uint8Array(nodes.length);
        holds = new Uint8Array(nodes.length);
        for (let i = nodes.length - 1; i >= 0; i--) {
          if (names[flat.n[i]].includes(q) || ownText[i].includes(q)) { hit[i] = 1; holds[i] = 1; count++; }
          if (holds[i] && flat.p[i] >= 0) holds[flat.p[i]] = 1;
        }
      } else {
        hit = holds = null;
      }
      paint();
      return count;
    });
    draw();
    let width = box.clientWidth;
    window.addEventListener("resize", function () { if (box.clientWidth !== width) { width = box.clientWidth; draw(); } });
  }

  // ------------------------------------------------------------ the ranks picture
  // rows: [{label, row: {expected, values: [[value, ranges], ...]}, kind, summary?, onClick}]
  // One line per row, one column per rank (several ranks per pixel when they do not
  // fit: a column then shows its most deviating rank).
  const KIND_TITLES = new Map(Object.entries({
    collective_order: ["Collectives out of order", "1 = the rank issues another collective at the first disagreement of its process group"],
    collective_dtype: ["Collective dtype mismatches", "1 = the rank issues the collective with another dtype"],
    collective_size: ["Collective size mismatches", "1 = the rank issues the collective with another size"],
    collective_reduce_op: ["Collective reduce-op mismatches", "1 = the rank issues the collective with another reduce op"],
    collective_missing: ["Collectives skipped", "1 = the rank skips the collective the others issue"],
    collective_extra: ["Extra collectives", "1 = the rank issues a collective the others do not"],
    collective_group: ["Collectives on another process group", "1 = the rank issues the collective on another group"],
    collective_mismatch: ["Collectives per rank", "collectives issued per rank, by calling function"],
    rank_specific: ["Functions only some ranks ran", "1 = the rank ran it"],
    count_skew: ["Count skew", "ops per rank, by function (ranks within the threshold shown as the median)"],
    dtype_mismatch: ["Dtype mismatches", "1 = the rank runs the op in another set of dtypes"],
  }));
  function cellColor(v, e, off, kind) {
    if (!off) return "#e9e9e9";
    if (v === e || typeof v !== "number" || typeof e !== "number") return "#8e24aa";
    if (kind === "rank_specific") return v > e ? "#ef6c00" : "#1565c0";
    if (v === 0) return "#0d47a1";
    const ratio = e ? Math.min(1, Math.abs(v - e) / e) : 1;
    const light = 78 - Math.round(40 * ratio);
    return v > e ? "hsl(0,80%," + light + "%)" : "hsl(215,75%," + light + "%)";
  }
  function rankMatrix(container, ranksText, rows, opts) {
    const ranks = parseRanges(ranksText);
    const position = new Map(ranks.map(function (r, i) { return [r, i]; }));
    const N = ranks.length;
    const block = add(container, "div", null, "ranks-block");
    block.setAttribute("data-role", "ranks");
    block.setAttribute("data-kind", opts.kind);
    const titles = KIND_TITLES.get(opts.kind) || [opts.kind, "1 = the ranks the finding names"];
    add(block, "h3", titles[0] + " (" + plural(rows.length - 1, "row") + ")");
    add(block, "p", titles[1] + "; grey: as expected; hover for values, click a row for its findings.", "note");
    const worst = [];
    for (const [v, text] of rows[0].row.values) for (const at of positions(text)) worst.push([v, ranks[at]]);
    worst.sort(function (x, y) { return y[0] - x[0] || x[1] - y[1]; });
    if (worst.length) {
      add(block, "p", "Ranks in the most findings: " + worst.slice(0, 8).map(function (p) { return "rank " + p[1] + " (" + num(p[0]) + ")"; }).join(", ") +
        (worst.length > 8 ? "; " + plural(worst.length, "rank") + " in at least one" : "") + ".", "note");
    }
    const canvas = add(block, "canvas");
    const legend = add(block, "div", null, "legend");
    const swatches = opts.kind === "rank_specific" || !KIND_TITLES.has(opts.kind)
      ? [["as expected", "#e9e9e9"], ["ran it (most did not)", "#ef6c00"], ["did not run it (most did)", "#1565c0"]]
      : [["as expected", "#e9e9e9"], ["more than expected", "hsl(0,80%,50%)"], ["fewer", "hsl(215,75%,55%)"], ["none (0)", "#0d47a1"], ["differs both ways", "#8e24aa"]];
    for (const [text, sw] of swatches.concat([["findings on the rank", "hsl(30,90%,55%)"]])) {
      const s = add(legend, "span", text);
      s.style.setProperty("--swatch", sw);
    }
    const pager = add(block, "div", null, "pager");
    const prev = el("button", "‹ prev"), next = el("button", "next ›"), where = el("span");
    pager.append(where, prev, next);
    const pageSize = 30;
    let page = 0, shown = rows.slice(1);
    // per row, sparse: the positions of its deviating ranks (sorted) and their values
    const sparse = new Map();
    function deviations(r) {
      let out = sparse.get(r);
      if (out) return out;
      const pairs = [];
      for (const [v, text] of r.row.values) for (const at of positions(text)) pairs.push([at, v]);
      pairs.sort(function (a, b) { return a[0] - b[0]; });
      out = { at: pairs.map(function (p) { return p[0]; }), v: pairs.map(function (p) { return p[1]; }), byPos: null };
      sparse.set(r, out);
      return out;
    }
    function valueAt(r, pos) {
      const d = deviations(r);
      if (!d.byPos) d.byPos = new Map(d.at.map(function (p, i) { return [p, d.v[i]]; }));
      return d.byPos.has(pos) ? [d.byPos.get(pos), true] : [r.row.expected, false];
    }
    // a rank set as ranges of ranks ("0-3,7") or a bitmap over rank positions ("~" base64)
    function positions(text) {
      const out = [];
      if (text.charAt(0) === "~") {
        const bytes = atob(text.slice(1));
        for (let i = 0; i < bytes.length; i++) {
          const b = bytes.charCodeAt(i);
          for (let bit = 0; bit < 8; bit++) if (b & (1 << bit)) out.push(i * 8 + bit);
        }
        return out.filter(function (at) { return at < N; });
      }
      for (const rank of parseRanges(text)) if (position.has(rank)) out.push(position.get(rank));
      return out;
    }
    let geo = null, visible = [];
    // read once and on resize: reading it in every draw would lay the page out again
    // for each block a keystroke redraws
    let blockWidth = block.clientWidth || 1000;
    function draw() {
      const labelW = Math.min(330, Math.max(180, Math.floor(blockWidth * 0.25)));
      const avail = Math.max(100, blockWidth - labelW - 4);
      const per = Math.max(1, Math.ceil(N / avail));
      const bins = Math.ceil(N / per);
      const cellW = per > 1 ? 1 : Math.max(1, Math.min(48, Math.floor(avail / N)));
      const rowH = N <= 64 ? 18 : 14, axisH = 16;
      visible = [rows[0]].concat(shown.slice(page * pageSize, (page + 1) * pageSize));
      const width = labelW + bins * cellW + 2, height = axisH + visible.length * rowH + 1;
      canvas.width = width;
      canvas.height = height;
      canvas.style.width = width + "px";
      canvas.style.height = height + "px";
      geo = { labelW: labelW, cellW: cellW, per: per, rowH: rowH, axisH: axisH, bins: bins };
      canvas.setAttribute("data-geometry", JSON.stringify(geo));
      const g = canvas.getContext("2d");
      g.fillStyle = "#fff";
      g.fillRect(0, 0, width, height);
      g.font = "11px monospace";
      g.textBaseline = "middle";
      // the rank axis: every rank where they fit, else a few ticks
      g.fillStyle = "#444";
      const steps = [1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128, 200, 256, 500, 512, 1000, 1024, 2048, 4096, 8192];
      const tick = cellW >= 22 ? 1 : steps.find(function (n) { return (n / per) * cellW >= 44; }) || N;
      g.fillText("rank", 4, axisH / 2);
      for (let i = 0; i < N; i += tick) {
        const x = labelW + Math.floor(i / per) * cellW;
        g.fillRect(x, axisH - 4, 1, 4);
        if (x + 2 + String(ranks[i]).length * 6.7 <= width) g.fillText(String(ranks[i]), x + 2, axisH / 2 - 1);
      }
      visible.forEach(function (r, k) {
        const y = axisH + k * rowH, e = r.row.expected;
        const d = deviations(r);
        g.fillStyle = r.summary ? "#7a4a00" : "#222";
        g.font = (r.summary ? "bold " : "") + "11px monospace";
        const fit = Math.floor((labelW - 8) / 6.7);
        const label = printable(r.label);
        const text = label.length > fit ? label.slice(0, Math.max(1, fit - 1)) + "…" : label;
        g.fillText(text, 4, y + rowH / 2);
        g.font = "11px monospace";
        const max = r.summary ? Math.max(1, ...d.v) : 0;
        function colour(v, off) {
          if (r.summary) return off && v ? "hsl(30,90%," + (80 - Math.round((35 * v) / max)) + "%)" : "#f3f3f3";
          return cellColor(v, e, off, r.kind);
        }
        if (cellW > 3) {  // a few ranks: every cell, with its value where it fits
          for (let b = 0; b < bins; b++) {
            const [v, off] = valueAt(r, b);
            const x = labelW + b * cellW;
            g.fillStyle = colour(v, off);
            g.fillRect(x, y + 1, cellW - 1, rowH - 2);
            const t = short(v);
            if (cellW >= 26 && t.length * 6.7 < cellW - 2) {
              g.fillStyle = !off ? "#666" : typeof v === "number" && v === 0 && typeof e === "number" && e > 0 ? "#fff" : "#000";
              g.fillText(t, x + 2, y + rowH / 2);
            }
          }
          return;
        }
        // many ranks: one strip as expected, then the deviating ranks over it, each
        // pixel column showing its most deviating rank, two pixels wide at least so
        // that one odd rank among a thousand still shows
        g.fillStyle = colour(e, false);
        g.fillRect(labelW, y + 1, bins * cellW, rowH - 2);
        const score = function (v) { return typeof v === "number" && typeof e === "number" ? 1 + Math.abs(v - e) : 1; };
        const best = new Map();
        for (let i = 0; i < d.at.length; i++) {
          const b = Math.floor(d.at[i] / per);
          if (!best.has(b) || score(d.v[i]) > score(d.v[best.get(b)])) best.set(b, i);
        }
        for (const [b, i] of best) {
          g.fillStyle = colour(d.v[i], true);
          g.fillRect(labelW + b * cellW, y + 1, r.summary ? cellW : Math.max(2, cellW), rowH - 2);
        }
      });
      where.textContent = shown.length > pageSize ? "rows " + num(page * pageSize + 1) + "–" + num(Math.min((page + 1) * pageSize, shown.length)) + " of " + num(shown.length) : "";
      prev.disabled = page === 0;
      next.disabled = (page + 1) * pageSize >= shown.length;
      pager.style.display = shown.length > pageSize ? "" : "none";
    }
    function at(ev) {
      const box = canvas.getBoundingClientRect();
      const x = ev.clientX - box.left, y = ev.clientY - box.top;
      const k = Math.floor((y - geo.axisH) / geo.rowH);
      if (k < 0 || k >= visible.length) return null;
      const b = Math.floor((x - geo.labelW) / geo.cellW);
      return { row: visible[k], bin: b >= 0 && b < geo.bins ? b : -1 };
    }
    canvas.addEventListener("mousemove", function (ev) {
      const hitAt = at(ev);
      if (!hitAt) { hideTip(); return; }
      const r = hitAt.row;
      const lines = [r.title || r.label];
      if (!r.summary) lines.push("expected (most ranks): " + num(r.row.expected));
      if (hitAt.bin >= 0) {
        const from = hitAt.bin * geo.per, to = Math.min(N, from + geo.per);
        const here = [];
        for (let i = from; i < to; i++) here.push("rank " + ranks[i] + ": " + num(valueAt(r, i)[0]) + (valueAt(r, i)[1] ? "" : " (as expected)"));
        lines.push(...here.slice(0, 8));
        if (here.length > 8) lines.push("… " + (here.length - 8) + " more ranks in this column");
      } else {
        const d = deviations(r);
        const off = d.at.slice(0, 8).map(function (at, i) { return "rank " + ranks[at] + ": " + num(d.v[i]); });
        lines.push(...(off.length ? off : ["every rank as expected"]));
        if (d.at.length > 8) lines.push("… " + plural(d.at.length, "rank") + " deviate");
      }
      showTip(ev, lines.join("\n"));
    });
    canvas.addEventListener("mouseleave", hideTip);
    canvas.addEventListener("click", function (ev) {
      const hitAt = at(ev);
      if (hitAt && hitAt.row.onClick) hitAt.row.onClick();
    });
    prev.addEventListener("click", function () { page--; draw(); });
    next.addEventListener("click", function () { page++; draw(); });
    onSearch(function (q) {
      const now = rows.slice(1).filter(function (r) { return !q || r.hay.includes(q); });
      const same = now.length === shown.length && now.every(function (r, i) { return r === shown[i]; });
      shown = now;
      if (!same || page) { page = 0; draw(); }
      return 0;  // the groups table counts these matches
    });
    draw();
    window.addEventListener("resize", function () { if (block.clientWidth !== blockWidth) { blockWidth = block.clientWidth; draw(); } });
  }

  // ------------------------------------------------------------ divergence of an entry
  function divergence(sec, entry, div) {
    const head = add(sec, "h3", div.findings ? "Divergence: " + plural(div.findings, "finding") + " (" + plural(div.errors, "error") + ", " +
      plural(div.warnings, "warning") + ") in " + plural(div.ngroups, "group") + " over " + plural(div.nranks, "rank") : "Divergence over " + plural(div.nranks, "rank") + ": none");
    head.id = "divergence-" + Number(entry.index);
    if (div.unshown) {  // the file is missing or unreadable: say what the run recorded, never "none"
      const r = div.recorded;
      head.textContent = "Divergence: not shown";
      add(sec, "p", div.note + (r && typeof r.findings === "number" ? "; the run recorded " + plural(r.findings, "finding") + " (" +
        plural(r.errors || 0, "error") + ", " + plural(r.warnings || 0, "warning") + ")" : ""), "note sev-error");
      return;
    }
    if (div.note) add(sec, "p", div.note, "note");
    if (!div.per_rank_stats) add(sec, "p", "The combined trace has no per-rank statistics (a rank came twice, or a version-1 combined input): only ranks that never ran something are reported.", "note");
    if (!div.findings) { add(sec, "p", "No divergence: every rank did the same.", "note"); return; }
    add(sec, "p", "Findings grouped by kind, function and the ranks that deviate" + (div.skew !== undefined && div.skew !== null ? " (count skew threshold " + div.skew + ")" : "") +
      "; every finding is in " + entry.name + "_divergence.json and .log." + (div.ngroups > div.groups.length ? " The report shows the first " + num(div.groups.length) + " groups." : ""), "note");
    const groups = div.groups;
    const table = { reveal: function () {} };
    // the picture first: which rank differs, where
    const kinds = [];
    for (const g of groups) if (!kinds.includes(g.kind)) kinds.push(g.kind);
    for (const kind of Object.keys(div.per_rank)) if (!kinds.includes(kind)) kinds.push(kind);
    kinds.sort(function (a, b) { return order(a) - order(b); });
    function order(kind) { const i = ["collective_order", "collective_dtype", "collective_size", "collective_reduce_op", "collective_missing", "collective_extra", "collective_group", "collective_mismatch", "rank_specific", "count_skew", "dtype_mismatch"].indexOf(kind); return i < 0 ? 11 : i; }
    for (const kind of kinds) {
      const rows = [{ label: "findings on the rank", summary: true, kind: kind, row: { expected: 0, values: div.per_rank[kind] || [] }, hay: "" }];
      groups.forEach(function (g, i) {
        if (g.kind !== kind) return;
        const colon = g.target.indexOf(":");
        rows.push({
          label: (colon >= 0 ? g.target.slice(colon + 1) : g.target) + (g.nops === 1 ? "  " + g.ops[0] : g.count > 1 ? "  (" + g.count + ")" : ""),
          title: g.target + (g.ops.length ? "  " + g.ops.join(", ") : ""),
          kind: kind,
          row: g.row,
          hay: groupHay(g),
          onClick: function () { table.reveal(i); },
        });
      });
      rankMatrix(sec, div.ranks, rows, { kind: kind });
    }
    const frames = div.frames, paths = div.paths;
    function stackOf(id) {
      const out = [];
      for (let p = id; p !== undefined && p >= 0; p = paths[p][0]) out.unshift(frames[paths[p][1]]);
      return out;
    }
    // a member's function: its own where the group has several ("f (and 9 more)")
    function targetOf(g, m) { return m.target !== undefined ? m.target : g.target; }
    function groupHay(g) {
      const members = g.members.map(function (m) { return (m.target || "") + " " + (m.message || ""); });
      return [g.kind, g.target, g.ops.join(" "), g.ranks[1], members.join(" ")].join("\n").toLowerCase();
    }
    function memberView(g, m) {
      const box = el("div", null, "member");
      const target = targetOf(g, m);
      const what = m.op ? m.op + (m.api ? " (" + m.api + ")" : "") + (m.stream !== undefined ? ", stream " + m.stream : "") +
        (m.target !== undefined ? " in " + m.target : "") : target;
      add(box, "div", what, "sev-" + m.severity);
      const facts = [];
      if (m.expected !== undefined) facts.push("expected " + num(m.expected));
      if (m.counts) facts.push(m.counts.map(function (p) { return "ranks " + rankSet([p[1], p[2]]) + ": " + num(p[0]); }).join("; "));
      if (m.missing) facts.push("not on ranks " + rankSet(m.missing));
      if (m.ops !== undefined) facts.push(plural(m.ops, "op"));
      if (facts.length) add(box, "div", facts.join(" · "));
      if (m.message) add(box, "div", m.message, "note");
      if (m.stack !== undefined) {
        const stack = stackOf(m.stack);
        const d = add(box, "details");
        add(d, "summary", "stack (" + plural(stack.length, "frame") + ", outermost first)").style.fontWeight = "normal";
        const ol = add(d, "ol", null, "stack");
        for (const f of stack) add(ol, "li", f, f === target ? "here" : "");
      } else if (m.callsite !== undefined) {  // a divergence file writes a few stacks a group
        add(box, "div", "stack: callsite " + m.callsite + " in " + entry.name + "_combined.json", "note");
      }
      return box;
    }
    const real = pagedTable(sec, {
      role: "findings",
      rows: groups,
      pageSize: 25,
      more: div.ngroups > groups.length ? num(div.ngroups - groups.length) + " more groups in the .log" : "",
      columns: [
        { title: "severity", width: "7%", text: function (g) { return g.severity; }, cls: function (g) { return "sev-" + g.severity; }, sort: function (g) { return g.severity === "error" ? 0 : 1; } },
        { title: "kind", width: "13%", text: function (g) { return g.kind; } },
        { title: "function", width: "31%", text: function (g) { return g.target; } },
        { title: "ranks", width: "17%", text: function (g) { return rankSet(g.ranks); }, sort: function (g) { return g.ranks[0]; } },
        { title: "findings", width: "7%", num: true, text: function (g) { return num(g.count); }, sort: function (g) { return g.count; } },
        { title: "ops", width: "17%", text: function (g) { return g.ops.join(", ") + (g.nops > g.ops.length ? " …" : ""); } },
        { title: "size", width: "8%", num: true, text: function (g) { return num(g.size); }, sort: function (g) { return g.size; } },
      ],
      haystack: groupHay,
      detail: function (g) {
        const box = el("div");
        add(box, "div", g.severity + " " + g.kind + " in " + g.target + ": " + plural(g.count, "finding") + " on ranks " + rankSet(g.ranks), "sev-" + g.severity);
        for (const m of g.members) box.appendChild(memberView(g, m));
        if (g.count > g.members.length) add(box, "p", num(g.count - g.members.length) + " more findings of this group in " + entry.name + "_divergence.log", "note");
        return box;
      },
    });
    table.reveal = real.reveal;
  }

  // ------------------------------------------------------------ the page
  const s = data.summary || {};
  const configs = data.configs || {};
  const notes = data.config_notes || {};
  const status = add(header, "div", null, "bar-line");
  add(status, "span", s.status || "?", "status-" + s.status);
  add(status, "span", "exit code " + (s.exit_code === undefined || s.exit_code === null ? "?" : s.exit_code));
  add(status, "span", plural(data.entries.length, "entry"));
  if (typeof s.seconds === "number") add(status, "span", s.seconds.toFixed(2) + " s");
  // {signal, stage, entry} of a run a signal ended; stage and entry may be null
  const i = s.interrupted;
  const interrupted = i && typeof i === "object" ? "interrupted by " + (i.signal || "a signal") +
    (i.stage ? " during " + i.stage + (i.entry ? " of " + i.entry : "") : "") : "";
  if (interrupted) add(status, "span", interrupted, "sev-error");
  const shown = function (d) { return d.unshown ? (d.recorded && typeof d.recorded.findings === "number" ? d.recorded.findings : 0) : d.findings; };
  const found = data.entries.reduce(function (n, e) { return n + (e.divergence ? shown(e.divergence) : 0); }, 0);
  if (data.entries.some(function (e) { return e.divergence; })) add(status, "span", plural(found, "divergence finding"), found ? "sev-error" : "");
  if ((s.warnings || []).length) add(status, "span", plural(s.warnings.length, "warning"), "sev-warning");
  const nav = add(header, "div", null, "bar-line");
  nav.append(searchBox, hitsNote);
  function link(text, id) { const a = add(nav, "a", text); a.href = "#" + id; }

  const own = function (object, key) { return Object.prototype.hasOwnProperty.call(object, key); };
  function configBlock(parent, name) {
    if (own(configs, name)) return configTable(parent, name, configs[name]);
    if (own(notes, name)) add(parent, "p", notes[name], "note");
    return null;
  }
  const finalName = data.final.filtered || data.final.final;
  const finalSec = section(data.final.filtered ? "Final config (filtered)" : "Final config", "final-config");
  link("final config", "final-config");
  if (finalName) {
    configBlock(finalSec, finalName);
    if (data.final.filtered && data.final.final) {
      lazyDetails(finalSec, "Before the filter stage: " + data.final.final, function (d) { configBlock(d, data.final.final); });
    }
  } else {
    add(finalSec, "p", "The run made no final config (see the stages below).", "note");
  }

  for (const entry of data.entries) {
    const id = "entry-" + Number(entry.index);
    const sec = section("Entry " + entry.index + ": " + entry.name, id);
    link("entry " + entry.index + ": " + entry.name, id);
    for (const f of entry.failures || []) add(sec, "p", "failed at " + f.stage + ": " + f.error, "sev-error");
    if (entry.divergence) divergence(sec, entry, entry.divergence);
    if (entry.tree) {
      add(sec, "h3", "Call tree (" + plural(entry.tree.c[0], "op") + (entry.tree.ranks ? " on " + plural(entry.tree.ranks, "rank") : "") + ")");
      icicle(sec, entry.tree);
    } else if (entry.tree_note) {
      add(sec, "h3", "Call tree: not shown");
      add(sec, "p", entry.tree_note, "note sev-error");
    }
    if (entry.config && entry.config !== finalName) {
      lazyDetails(sec, "Instrumentation config: " + entry.config, function (d) { configBlock(d, entry.config); }, !finalName);
    } else if (entry.config) {
      add(sec, "p", "This entry's config, " + entry.config + ", is the final config above.", "note");
    }
  }

  const run = section("Run", "run");
  link("run", "run");
  const sides = add(run, "div", null, "side-by-side");
  const facts = add(add(sides, "div"), "table", null, "facts");
  for (const [k, v] of [["status", s.status], ["exit code", s.exit_code], ["interrupted", interrupted], ["started", s.started_at], ["finished", s.finished_at],
    ["seconds", s.seconds], ["run directory", s.run_dir], ["inputs", (s.inputs || []).join(" ")], ["skipped stages", (s.skipped_stages || []).join(", ")],
    ["disabled plugins", (s.disabled_plugins || []).join(", ")], ["opguard", s.opguard_version]]) {
    if (v === undefined || v === null || v === "") continue;
    const tr = add(facts, "tr");
    add(tr, "td", k);
    add(tr, "td", v);
  }
  const stagesBox = add(sides, "div");
  pagedTable(stagesBox, {
    role: "stages",
    rows: s.stages || [],
    pageSize: 100,
    columns: [
      { title: "stage", width: "18%", text: function (r) { return r.stage; } },
      { title: "entry", width: "27%", text: function (r) { return r.entry || ""; } },
      { title: "status", width: "11%", text: function (r) { return r.status; }, cls: function (r) { return "status-" + r.status; } },
      { title: "plugin", width: "17%", text: function (r) { return r.plugin || ""; } },
      { title: "seconds", width: "11%", num: true, text: function (r) { return typeof r.seconds === "number" ? r.seconds.toFixed(3) : num(r.seconds); }, sort: function (r) { return typeof r.seconds === "number" ? r.seconds : 0; } },
      { title: "error", width: "16%", text: function (r) { return r.error || ""; } },
    ],
    detail: function (r) { return detailGrid([["error", r.error], ["outputs", (r.outputs || []).join(", ")]]); },
  });
  if ((s.warnings || []).length) {
    add(run, "h3", "Warnings");
    const ul = add(run, "ul");
    for (const w of s.warnings) {
      const rest = Object.keys(w).filter(function (k) { return k !== "message" && w[k] !== null && w[k] !== undefined; })
        .map(function (k) { return k + "=" + (typeof w[k] === "object" ? JSON.stringify(w[k]) : w[k]); });
      add(ul, "li", w.message + (rest.length ? " (" + rest.join(", ") + ")" : ""));
    }
  }
  if (data.comparisons.length) {
    const sec = section("Comparisons", "comparisons");
    link("comparisons", "comparisons");
    for (const c of data.comparisons) lazyDetails(sec, c.name, function (d) { add(d, "pre", c.text); });
  }
  // deep links (report.html#entry-2): the sections exist only now, so scroll here
  const target = location.hash ? document.getElementById(location.hash.slice(1)) : null;
  if (target) target.scrollIntoView();
  document.body.setAttribute("data-ready", "1");
})();
