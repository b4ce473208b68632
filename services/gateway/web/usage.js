// Usage: the limits in force and their use, cost per day as a chart, and calls, tokens
// and cost per agent and model.
import { api, el, header, timeEl, token } from "/common.js";
await header();
const SVG = "http://www.w3.org/2000/svg";
const usd = (micros) => `$${(micros / 1e6).toFixed(4)}`;
function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
const writes = (u) => u.cache_write_5m_tokens + u.cache_write_1h_tokens;
// The share of the prompt that was read from the cache (the cheap part).
function cacheShare(u) {
  const prompt = u.input_tokens + u.cache_read_tokens + writes(u);
  return prompt ? `${Math.round((100 * u.cache_read_tokens) / prompt)}%` : "–";
}

// Cost per day, as bars in inline SVG; the figure's caption and each bar's title say the figures.
function chart(days) {
  const figure = document.getElementById("chart");
  days.sort((a, b) => (a.key.day < b.key.day ? -1 : 1));
  if (!days.length) { figure.replaceChildren(el("figcaption", {}, "No model calls yet.")); return; }
  const W = 640, H = 200, pad = 30, top = Math.max(...days.map((d) => d.cost_micros), 1);
  const step = (W - 2 * pad) / days.length, bar = Math.min(48, step * 0.7);
  const chartSvg = svg("svg", { viewBox: `0 0 ${W} ${H + 40}`, role: "img", "aria-labelledby": "chart-caption" });
  chartSvg.append(svg("line", { class: "axis", x1: pad, y1: H, x2: W - pad, y2: H }));
  days.forEach((d, i) => {
    const h = Math.max(1, ((H - 20) * d.cost_micros) / top);
    const x = pad + i * step + (step - bar) / 2;
    const rect = svg("rect", { class: "bar", x, y: H - h, width: bar, height: h, "data-day": d.key.day });
    rect.append(svg("title", {}, `${d.key.day}: ${usd(d.cost_micros)}, ${d.calls} calls`));
    chartSvg.append(rect,
      svg("text", { x: x + bar / 2, y: H - h - 4, "text-anchor": "middle" }, usd(d.cost_micros)),
      svg("text", { x: x + bar / 2, y: H + 16, "text-anchor": "middle" }, d.key.day.slice(5)));
  });
  const caption = days.map((d) => `${d.key.day} ${usd(d.cost_micros)}`).join(", ");
  figure.replaceChildren(chartSvg, el("figcaption", { id: "chart-caption", class: "visually-hidden" }, `Cost per day: ${caption}`));
}

// What each limit in force has used in its current window (held: calls in flight).
const WHAT = {
  "micros/day": "spend today", "micros/month": "spend this month",
  "requests/minute": "model calls this minute", "tokens/minute": "tokens this minute",
};
function limits(status) {
  const figure = (u, v) => (u.metric === "micros" ? usd(v) : v.toLocaleString());
  const rows = status.limits.map((u) => {
    const used = u.used + u.held;
    const share = u.limit ? Math.min(1, used / u.limit) : 1;
    const whose = u.scope === "project" ? `project ${u.name}` : `you (${u.name})`;
    return el("tr", { "data-limit": `${u.scope}/${u.metric}/${u.window}`, class: used >= u.limit ? "exhausted" : "" },
      el("td", {}, whose), el("td", {}, WHAT[`${u.metric}/${u.window}`] || `${u.metric} per ${u.window}`),
      el("td", { class: "num" }, figure(u, used)), el("td", { class: "num" }, figure(u, u.limit)),
      el("td", {}, el("meter", { min: "0", max: "1", low: "0.8", high: "0.95", optimum: "0", value: String(share), "aria-label": `${Math.round(share * 100)}% used` })),
      el("td", {}, timeEl(u.resets_at, u.window !== "minute")));
  });
  const body = document.querySelector("#limits tbody");
  if (rows.length) body.replaceChildren(...rows);
  else body.replaceChildren(el("tr", {}, el("td", { colspan: "6" }, "No limits are set.")));
}

if (token) {
  const [byDay, byModel, status] = await Promise.all([
    api("/usage?group_by=day"), api("/usage?group_by=agent,model"), api("/limits")]);
  limits(status);
  chart(byDay.groups);
  const num = (v) => el("td", { class: "num" }, v);
  document.querySelector("#usage tbody").replaceChildren(...byModel.groups.map((g) => el("tr", {},
    el("td", {}, g.key.agent || ""), el("td", {}, g.key.model || ""), num(g.calls),
    num(g.usage.input_tokens), num(g.usage.output_tokens), num(g.usage.cache_read_tokens),
    num(writes(g.usage)), num(cacheShare(g.usage)), num(usd(g.cost_micros)))));
  document.getElementById("total").textContent = `${byModel.total_calls} calls, ${usd(byModel.total_cost_micros)} in all`;
}
document.getElementById("usage").dataset.loaded = "true";
