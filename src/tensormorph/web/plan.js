// Tensormorph placement planner page: the form's devices and workload go to /api/plan, and the answer is
// drawn as one stacked bar per device (weights, KV cache, activations, reserve, free), sized by memory.
// It says what it plans: a decoder's prefill and decoding with a KV cache, or an encoder's one forward pass
// (no KV cache, no decoding). A folder holding only a config.json opens here (#ck=ID picks a checkpoint).
// "Measure" runs the plan on one process per device (POST /api/plan/measure) and shows, beside each bar, what the
// stage measured against what the plan predicted for it.

import { ApiError, apiUrl, getJSON } from './api.js';
import { bytes, count, el, int } from './format.js';

const $ = (id) => document.getElementById(id);

/** What is on screen, readable by tests through window.tensormorphPlan.state. */
const state = { checkpoints: [], plan: null, error: null, runs: 0, measurement: null, measureError: null, measures: 0 };
const FAR = 2;  // a measured stage time beyond ×2 of the prediction, either way, is flagged
const SEGMENTS = [['weights', 'weights', 'weights'], ['kv', 'kv_cache', 'KV cache'],
  ['act', 'activations', 'activations'], ['reserve', 'reserve', 'reserve']];

let resolveReady;
const ready = new Promise((resolve) => { resolveReady = resolve; });

const field = (id) => $(id).value.trim();

function request(path = '/api/plan', extra = {}) {
  const url = new URL(apiUrl(path, {
    ck: field('ck'), context: field('context'), batch: field('batch'), prefill_chunk: field('prefill-chunk'),
    cache_dtype: field('cache-dtype'), link: field('link'), strategy: field('strategy'), optimize: field('optimize'),
    uneven: $('uneven').checked ? 1 : null, ...extra,
  }), location.href);
  // repeated, not joined: a device spec holds commas of its own
  for (const line of $('devices').value.split('\n')) if (line.trim()) url.searchParams.append('device', line.trim());
  return url;
}

async function run() {
  const url = request();
  clearMeasurement();
  try {
    const response = await fetch(url);
    const body = await response.json().catch(() => ({ error: `${response.status} ${response.statusText}` }));
    if (!response.ok) throw new ApiError(response.status, body, url.href);
    state.plan = body;
    state.error = null;
    render(body);
  } catch (err) {
    state.plan = null;
    state.error = err.message;
    $('plan-bars').replaceChildren();
    $('plan-overall').replaceChildren();
    $('plan-notes').replaceChildren();
    $('plan-what').textContent = '';
    verdict(`Cannot plan: ${err.message}`, 'bad');
  }
  state.runs += 1;
  document.body.dataset.runs = String(state.runs);
}

function rate(tokens, seconds) {
  return seconds > 0 ? `${int(Math.round(tokens / seconds))} tok/s` : '–';
}

function ms(seconds) {
  if (seconds === null || seconds === undefined) return '–';
  if (seconds >= 1) return `${seconds.toFixed(2)} s`;
  return seconds >= 1e-3 ? `${(seconds * 1e3).toFixed(2)} ms` : `${(seconds * 1e6).toFixed(1)} µs`;
}

/** A checkpoint's folder name: its path may end at a file as plain as model.safetensors. */
function modelName(path) {
  const parts = path.split(/[\\/]/).filter(Boolean);
  const file = parts.length > 1 && /\.(safetensors|bin|pt|pth|json|gguf)$/.test(parts[parts.length - 1]);
  return parts[parts.length - (file ? 2 : 1)] || path;
}

function bar(d, scale) {
  // widths are shares of the largest memory (or use, when over), so devices compare at a glance
  const extent = Math.max(d.memory, d.used);
  const segments = SEGMENTS.map(([kind, key, label]) => el('div', {
    class: `seg ${kind}`, 'data-kind': kind, 'data-bytes': d[key], title: `${label} ${bytes(d[key])}`,
    style: { width: `${(100 * d[key]) / extent}%` },
  }));
  if (d.free > 0) {
    segments.push(el('div', { class: 'seg free', 'data-kind': 'free', 'data-bytes': d.free, title: `free ${bytes(d.free)}`,
      style: { width: `${(100 * d.free) / extent}%` } }));
  }
  const track = el('div', { class: 'track', style: { width: `${(100 * extent) / scale}%` } },
    el('div', { class: `bar${d.fits ? '' : ' over'}`, 'data-testid': 'plan-bar' }, segments));
  if (!d.fits) {  // hatch what lies beyond the device's memory
    track.append(el('div', { class: 'seg over over-mark', 'data-kind': 'over', 'data-bytes': -d.free,
      title: `over by ${bytes(-d.free)}`,
      style: { position: 'absolute', top: '0', left: `${(100 * d.memory) / extent}%`, width: `${(-100 * d.free) / extent}%` } }));
  }
  return track;
}

function holds(d) {
  if (d.share) return `${d.share.heads} heads · ${Math.round(d.share.mlp * 100)}% MLP`;
  const sides = d.modules.filter((m) => !/\.\d+$/.test(m)).map((m) => m.split('.').pop());
  const experts = d.expert_layers ? `experts of ${d.expert_layers}` : null;  // routed experts held apart (host)
  return [d.layers && `layers ${d.layers}`, ...sides, experts].filter(Boolean).join(' + ') || 'nothing';
}

function render(p) {
  const m = p.model;
  const encoder = p.model_kind === 'encoder';
  document.body.classList.toggle('encoder', encoder);
  $('optimize').disabled = encoder;  // an encoder has no decoding to optimise for, nor a KV cache
  $('cache-dtype').disabled = encoder;
  $('plan-model').replaceChildren(...[el('span', {}, el('b', {}, m.name)), el('span', {}, el('b', {}, count(m.params)), ' params'),
    el('span', {}, el('b', {}, bytes(m.weight_bytes)), ` ${m.dtype}`), el('span', {}, el('b', {}, int(m.layers)), ' layers'),
    el('span', { 'data-testid': 'plan-kind' }, encoder ? 'encoder-only' : 'decoder'),
    m.source === 'config' ? el('span', { title: m.path }, 'from config.json (no weights)') : null,
    el('span', {}, `${p.strategy} · ${int(p.workload.context)} × ${p.workload.batch} tokens`)].filter(Boolean));
  $('plan-what').textContent = p.plans ? `Plans: ${p.plans}.` : '';
  // a device given by memory alone has no speed: no rates at all, rather than dashes that read as zero
  const known = p.speed_known !== false;
  const speed = (d) => {
    if (!known) return el('span', { class: 'speed-unknown', 'data-testid': 'plan-speed' }, ' · speed unknown');
    return el('span', { 'data-testid': 'plan-speed' }, encoder
      ? ` · forward ${rate(p.workload.batch * p.workload.context, d.prefill.stage_s)}`
      : ` · decode ${rate(p.workload.batch, d.decode.stage_s)} · prefill ${rate(p.workload.batch * p.workload.context, d.prefill.stage_s)}`);
  };
  const scale = Math.max(...p.devices.map((d) => Math.max(d.memory, d.used)));
  $('plan-bars').replaceChildren(...p.devices.map((d) => el('div', {
    class: 'plan-device', 'data-testid': 'plan-device', 'data-device': d.device,
  },
  el('div', { class: 'label' }, d.device, el('small', {}, holds(d))),
  bar(d, scale),
  el('div', { class: 'detail' }, `${bytes(d.used)} / ${bytes(d.memory)} · `,
    d.fits ? `${bytes(d.free)} free` : el('b', { class: 'bad' }, `over by ${bytes(-d.free)}`), speed(d)))));
  const o = p.overall;
  const tokens = p.workload.batch * p.workload.context;
  let overall;
  if (!known) {
    overall = 'Speed unknown: a device was given by its memory alone (add tflops= and bw=, or a model name such as '
      + 'rtx3090, for a speed estimate). ';
  } else if (encoder) {
    overall = `Overall: one forward pass ${rate(tokens, o.prefill_s)} (${ms(o.prefill_s)}). `;
  } else {
    overall = `Overall: decode ${rate(p.workload.batch, o.decode_step_s)} (${ms(o.decode_step_s)} per step), `
      + `prefill ${rate(tokens, o.prefill_s)} (${ms(o.prefill_s)}). `;
  }
  $('plan-overall').replaceChildren(el('span', { 'data-testid': 'plan-rate' }, overall),
    el('span', { 'data-testid': 'plan-bottleneck' }, known ? `Bottleneck (${p.bottleneck.limit}): ${p.bottleneck.reason}`
      : `Placed by memory alone: ${p.bottleneck.reason.replace(/^speed unknown: placed by memory alone; /, '')}`));
  if (p.fits) {
    verdict('Fits.', 'good');
  } else {
    const over = Object.entries(p.shortfall.over).map(([name, n]) => `${name} over by ${bytes(n)}`).join(', ');
    const fixes = p.shortfall.suggestions.length ? ` Would fit with: ${p.shortfall.suggestions.join(' · ')}.` : '';
    verdict(`Does not fit: ${over}.${fixes}`, 'bad');
  }
  $('plan-notes').replaceChildren(...p.notes.map((n) => el('li', {}, n)));
}

function clearMeasurement() {
  state.measurement = null;
  state.measureError = null;
  $('plan-measured').className = 'plan-line plan-measured';
  $('plan-measured').replaceChildren();
}

/** Run the plan on real processes and show each stage's measurement beside its bar. */
async function measureRun() {
  const button = $('measure-button');
  button.disabled = true;
  clearMeasurement();
  $('plan-measured').textContent = 'Measuring: one process per device, one prompt…';
  const url = request('/api/plan/measure', { prompt_tokens: field('prompt-tokens'), new_tokens: field('new-tokens') });
  try {
    const response = await fetch(url, { method: 'POST' });
    const body = await response.json().catch(() => ({ error: `${response.status} ${response.statusText}` }));
    if (!response.ok) throw new ApiError(response.status, body, url.href);
    state.plan = body.plan;  // the plan that was run: its bars, with the measurement beside them
    state.error = null;
    render(body.plan);
    state.measurement = body;
    showMeasurement(body);
  } catch (err) {
    state.measureError = err.message;
    $('plan-measured').className = 'plan-line plan-measured bad';
    $('plan-measured').textContent = `Cannot measure: ${err.message}`;
  } finally {
    button.disabled = false;
    state.measures += 1;
    document.body.dataset.measures = String(state.measures);
  }
}

function ratio(value) {
  if (value === null || value === undefined) return el('span', { class: 'ratio' }, 'no prediction');
  const far = value > FAR || value < 1 / FAR;
  return el('span', { class: `ratio${far ? ' far' : ''}`, 'data-testid': 'measure-ratio' }, `×${value.toFixed(2)}`);
}

function phaseLine(t, label, per) {
  return el('span', { 'data-testid': `measure-${label}`,
    title: `compute ${ms(t.compute_s)} · transfer ${ms(t.transfer_s)} · idle ${ms(t.idle_s)} · send ${ms(t.send_s)}` },
  `${label} `, el('b', {}, ms(t.stage_s)), `${per} measured, ${ms(t.predicted_stage_s)} predicted `, ratio(t.ratio),
  ` · idle ${ms(t.idle_s)}`);
}

function showMeasurement(m) {
  const scale = Math.max(...m.stages.flatMap((s) => [s.decode.stage_s, s.decode.predicted_stage_s || 0]));
  for (const s of m.stages) {
    const row = document.querySelector(`.plan-device[data-device="${CSS.escape(s.device)}"]`);
    if (!row) continue;
    const p = s.predicted_memory;
    row.append(el('div', { class: 'times', title: 'decode step: predicted (grey) and measured (green)' },
      el('div', { class: 'time predicted', style: { width: `${(100 * (s.decode.predicted_stage_s || 0)) / scale}%` } }),
      el('div', { class: 'time measured', style: { width: `${(100 * s.decode.stage_s) / scale}%` } })),
    el('div', { class: 'measure', 'data-testid': 'plan-measure', 'data-device': s.device },
      el('span', {}, `ran on ${s.ran_on}`),
      phaseLine(s.prefill, 'prefill', ''), phaseLine(s.decode, 'decode', ' per step'),
      el('span', { 'data-testid': 'measure-memory' }, 'tensors ', el('b', {}, bytes(s.tensor_bytes)),
        ` (plan ${bytes(p.weights)}) · KV cache `, el('b', {}, bytes(s.kv_cache_bytes)), ` (plan ${bytes(p.kv_cache)})`,
        ` · RSS +${bytes(s.rss_growth)}`)));
  }
  const o = m.overall;
  $('plan-measured').className = 'plan-line plan-measured';
  $('plan-measured').replaceChildren(el('span', { 'data-testid': 'measure-overall' },
    `Measured on ${m.stages.length} process${m.stages.length === 1 ? '' : 'es'} (prompt ${m.prompt_tokens} × `
      + `${m.batch}, then ${m.new_tokens} decode steps): prefill ${ms(o.prefill_s)}, predicted ${ms(o.predicted_prefill_s)} `),
  ratio(o.prefill_ratio), ` · decode ${ms(o.decode_step_s)} per step, predicted ${ms(o.predicted_decode_step_s)} `,
  ratio(o.decode_ratio), el('span', { class: 'muted' }, m.notes.length ? ` (${m.notes.join('; ')})` : ''));
}

function verdict(text, kind) {
  const box = $('plan-verdict');
  box.className = `plan-line ${kind}`;
  box.textContent = text;
}

async function boot() {
  $('viewer-link').href = `./${location.search}`;
  state.checkpoints = await getJSON('/api/checkpoints');
  // nothing to view but configs: the viewer would only send us back here
  $('viewer-link').hidden = state.checkpoints.every((c) => c.config_only);
  $('ck').replaceChildren(...state.checkpoints.map((c) => el('option', { value: c.id },
    `${c.id.toUpperCase()} · ${modelName(c.path)}${c.config_only ? ' (config.json)' : ''}`)));
  const wanted = new URLSearchParams(location.hash.slice(1)).get('ck');
  if (state.checkpoints.some((c) => c.id === wanted)) $('ck').value = wanted;
  $('plan-form').addEventListener('submit', (e) => { e.preventDefault(); run(); });
  $('measure-button').addEventListener('click', () => { measureRun(); });
  await run();
  document.body.dataset.ready = '1';
  resolveReady(state);
}

window.tensormorphPlan = { state, ready, run, measure: measureRun };

boot().catch((err) => {
  state.error = err.message;
  document.body.dataset.error = err.message;
  verdict(`Error: ${err.message}`, 'bad');
});
