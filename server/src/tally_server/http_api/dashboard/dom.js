/* Building DOM trees without innerHTML, and morphing a freshly built tree into the page.
 *
 * Views are plain functions that return detached nodes; morphChildren() then patches the live page to
 * match, so unchanged nodes, focus, text selection and scroll stay put. Rows with a data-key attribute
 * are matched by key (a reordered table moves its rows rather than rewriting them all).
 */

const SVG_NS = "http://www.w3.org/2000/svg";

/** Appends children: nodes, strings (as text nodes), nested arrays; skips null, undefined and booleans. */
export function add(el, kids) {
  for (const kid of kids) {
    if (kid === null || kid === undefined || kid === false || kid === true) continue;
    if (Array.isArray(kid)) add(el, kid);
    else el.appendChild(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

function setAttrs(el, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    el.setAttribute(k, v === true ? "" : String(v));
  }
}

/** h("div", {class: "x"}, child, [children], "text") */
export function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  return add(el, kids);
}

/** The same for SVG elements. */
export function s(tag, attrs, ...kids) {
  const el = document.createElementNS(SVG_NS, tag);
  setAttrs(el, attrs);
  return add(el, kids);
}

function keyOf(node) {
  return node.nodeType === 1 ? node.getAttribute("data-key") : null;
}

function patch(old, fresh) {
  if (old.nodeType !== 1) {
    if (old.nodeValue !== fresh.nodeValue) old.nodeValue = fresh.nodeValue;
    return;
  }
  for (const { name } of Array.from(old.attributes)) {
    if (!fresh.hasAttribute(name)) old.removeAttribute(name);
  }
  for (const { name, value } of Array.from(fresh.attributes)) {
    if (old.getAttribute(name) !== value) old.setAttribute(name, value);
  }
  // Properties the user changes do not follow their attributes: set them, except under the user's cursor.
  if (old.tagName === "INPUT") {
    if (old.type === "checkbox") old.checked = fresh.hasAttribute("checked");
    else if (fresh.hasAttribute("value") && document.activeElement !== old && old.value !== fresh.getAttribute("value")) {
      old.value = fresh.getAttribute("value");
    }
  }
  if (old.tagName === "BUTTON") old.disabled = fresh.hasAttribute("disabled");
  morphChildren(old, fresh);
}

/** Makes parent's children match freshParent's, reusing parent's nodes where they fit. */
export function morphChildren(parent, freshParent) {
  const fresh = Array.from(freshParent.childNodes);
  const keyed = new Map();
  for (const child of parent.childNodes) {
    const key = keyOf(child);
    if (key !== null) keyed.set(key, child);
  }
  const used = new Set();
  let i = 0;
  for (const node of fresh) {
    const current = parent.childNodes[i] || null;
    const key = keyOf(node);
    if (key !== null) {
      const match = keyed.get(key);
      if (match && !used.has(match) && match.nodeName === node.nodeName) {
        used.add(match);
        if (match !== current) parent.insertBefore(match, current);
        patch(match, node);
      } else {
        parent.insertBefore(node, current);
      }
    } else if (!current) {
      parent.appendChild(node);
    } else if (current.nodeType === node.nodeType && current.nodeName === node.nodeName && keyOf(current) === null) {
      patch(current, node);
    } else {
      parent.insertBefore(node, current);
    }
    i++;
  }
  while (parent.childNodes.length > i) parent.removeChild(parent.lastChild);
}
