// Runs report.html's script under Node in a small stand-in for the DOM, opens every
// <details> and every row of the findings tables, optionally types a search, and
// prints the page's elements as lines "tag.class[data-role]: text" (indented by depth), so
// tests/test_report.py can check what the page shows where Chromium is missing.
// Usage: node tests/report_dom.js REPORT.html [SEARCH]
"use strict";
const fs = require("fs");
const vm = require("vm");

const html = fs.readFileSync(process.argv[2], "utf8");
const data = /<script type="application\/json" id="opguard-data">([\s\S]*?)<\/script>/.exec(html)[1];
const code = /<script>\n([\s\S]*?)<\/script>/.exec(html)[1];

class Node {}
class Element extends Node {
  constructor(tag) {
    super();
    this.tagName = tag;
    this.children = [];
    this.parent = null;
    this.text = "";
    this.className = "";
    this.attributes = {};
    this.listeners = {};
    this.style = { setProperty: function () {} };
    this.clientWidth = 0;
    const self = this;
    this.classList = {
      add: function (c) { if (!self.classList.contains(c)) self.className = (self.className + " " + c).trim(); },
      remove: function (c) { self.className = self.className.split(" ").filter(function (x) { return x !== c; }).join(" "); },
      contains: function (c) { return self.className.split(" ").includes(c); },
      toggle: function (c, on) { if (on === undefined) on = !self.classList.contains(c); if (on) self.classList.add(c); else self.classList.remove(c); },
    };
  }
  get textContent() { return this.text + this.children.map(function (c) { return c.textContent; }).join(""); }
  set textContent(value) { this.text = String(value); this.children.forEach(function (c) { c.parent = null; }); this.children = []; }
  get childNodes() { return this.children; }
  get nextSibling() { return this.parent ? this.parent.children[this.parent.children.indexOf(this) + 1] || null : null; }
  appendChild(child) { if (child.parent) child.remove(); child.parent = this; this.children.push(child); return child; }
  append(...nodes) { for (const n of nodes) this.appendChild(n); }
  after(node) { if (node.parent) node.remove(); node.parent = this.parent; this.parent.children.splice(this.parent.children.indexOf(this) + 1, 0, node); }
  remove() { if (this.parent) this.parent.children.splice(this.parent.children.indexOf(this), 1); this.parent = null; }
  replaceChildren(...nodes) { this.textContent = ""; this.append(...nodes); }
  setAttribute(name, value) { this.attributes[name] = String(value); }
  getAttribute(name) { return this.attributes[name]; }
  addEventListener(type, fn) { (this.listeners[type] = this.listeners[type] || []).push(fn); }
  dispatchEvent(event) { for (const fn of this.listeners[event.type] || []) fn(event); }
  querySelector() { return null; }
  scrollIntoView() {}
  getBoundingClientRect() { return { left: 0, top: 0 }; }
  getContext() { return new Proxy({}, { get: function () { return function () {}; }, set: function () { return true; } }); }
  all() { return [this].concat(...this.children.map(function (c) { return c.all(); })); }
}
class Event { constructor(type) { this.type = type; } }

const body = new Element("body");
const byId = { "opguard-data": Object.assign(new Element("script"), { text: data }) };
for (const id of ["top", "content"]) byId[id] = body.appendChild(new Element(id === "top" ? "header" : "main"));
const document = {
  body: body,
  createElement: function (tag) { return new Element(tag); },
  getElementById: function (id) { return byId[id] || null; },
};
const window = { innerWidth: 1400, innerHeight: 900, addEventListener: function () {} };
vm.runInNewContext(code, { document, window, location: { hash: "" }, Event, Node, atob, Intl, console });

const clicked = new Set();
for (let again = true; again;) {  // opening a row or a <details> may add more of both
  again = false;
  for (const e of body.all()) {
    if (clicked.has(e)) continue;
    if (e.tagName === "details") { clicked.add(e); e.open = true; e.dispatchEvent(new Event("toggle")); again = true; }
    if (e.tagName === "tr" && e.classList.contains("row") && e.parent.parent.attributes["data-role"] === "findings") {
      clicked.add(e); e.dispatchEvent(new Event("click")); again = true;
    }
  }
}
if (process.argv[3] !== undefined) {
  const box = body.all().find(function (e) { return e.attributes["data-role"] === "search"; });
  box.value = process.argv[3];
  box.dispatchEvent(new Event("input"));
}
(function show(e, depth) {
  const role = e.attributes["data-role"];
  const name = e.tagName + (e.className ? "." + e.className.split(" ").filter(Boolean).join(".") : "") + (role ? "[" + role + "]" : "");
  process.stdout.write("  ".repeat(depth) + name + ": " + e.text + "\n");
  for (const c of e.children) show(c, depth + 1);
})(body, 0);
