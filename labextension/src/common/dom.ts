/**
 * The one DOM builder of the panel and the dashboard: h('div', { class: 'x' }, child, 'text').
 * No framework: both views update a handful of nodes in place, and the widget bundle stays small.
 */

type Value = string | number | boolean | null | undefined;
export type Attrs = Record<string, Value | ((event: any) => void)>;
export type Child = Node | string | null | undefined | false;

/**
 * An element with `attrs` and `children`. `class` sets the class name, `on<event>` functions
 * are listeners, what the element has as a property (type, min, value, hidden, title) is set
 * as one, anything else (data-*, aria-*) as an attribute. Null, undefined and false values
 * and children are skipped.
 */
export function h<K extends keyof HTMLElementTagNameMap>(tag: K, attrs: Attrs = {}, ...children: Child[]): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (typeof value === 'function') {
      node.addEventListener(key.slice(2), value);
    } else if (value === null || value === undefined || value === false) {
      continue;
    } else if (key === 'class') {
      node.className = String(value);
    } else if (key in node && !key.includes('-')) {
      (node as any)[key] = value;
    } else {
      node.setAttribute(key, String(value));
    }
  }
  node.append(...children.filter((c): c is Node | string => c !== null && c !== undefined && c !== false));
  return node;
}

/** An SVG element (sparklines): attributes only. */
export function svg(tag: string, attrs: Record<string, Value> = {}, ...children: Node[]): SVGElement {
  const node = document.createElementNS('http://www.w3.org/2000/svg', tag) as SVGElement;
  for (const [key, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined && value !== false) {
      node.setAttribute(key, String(value));
    }
  }
  node.append(...children);
  return node;
}
