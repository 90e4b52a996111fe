// The page header and the config card: checkpoint tabs (A, B, the diff), the active checkpoint's key
// figures, and the key facts of a Hugging Face config.json beside it.

import { bytes, count, el, int } from './format.js';

const CONFIG_LABELS = [
  ['architectures', 'architecture'], ['model_type', 'model type'], ['num_hidden_layers', 'layers'],
  ['hidden_size', 'hidden size'], ['num_attention_heads', 'attention heads'], ['num_key_value_heads', 'KV heads'],
  ['intermediate_size', 'intermediate size'], ['vocab_size', 'vocabulary'], ['torch_dtype', 'torch dtype'],
];

/** The tabs: one per checkpoint, and "A ⇄ B" with two; go(id) switches. */
export function renderTabs(tabs, checkpoints, active, go) {
  tabs.replaceChildren();
  for (const c of checkpoints) {
    const name = c.path.split(/[\\/]/).filter(Boolean).pop() || c.path;
    tabs.append(el('button', {
      type: 'button', class: `tab${active === c.id ? ' on' : ''}`, role: 'tab', 'data-testid': `tab-${c.id}`,
      'aria-selected': String(active === c.id), title: `${c.path}\n${c.format} · ${int(c.tensor_count)} tensors`,
      onclick: () => go(c.id),
    }, el('span', { class: 'id' }, c.id.toUpperCase()), el('span', { class: 'path' }, name), el('span', { class: 'fmt' }, c.format)));
  }
  if (checkpoints.length > 1) {
    tabs.append(el('button', {
      type: 'button', class: `tab${active === 'diff' ? ' on' : ''}`, role: 'tab', 'data-testid': 'tab-diff',
      'aria-selected': String(active === 'diff'), title: 'Compare A and B, tensor by tensor', onclick: () => go('diff'),
    }, el('span', { class: 'id' }, 'A ⇄ B'), el('span', {}, 'Diff')));
  }
}

/** The header's figures: path, format, tensors, params, bytes, files (or both paths in the diff view). */
export function renderCheckpointInfo(info, { checkpoints, active, summary }) {
  if (active === 'diff') {
    const [a, b] = checkpoints;
    info.replaceChildren(el('span', { class: 'path', title: a.path }, a.path), el('span', {}, 'vs'),
      el('span', { class: 'path', title: b.path }, b.path));
    return;
  }
  if (!summary) return;
  const s = summary;
  info.replaceChildren(
    el('span', { class: 'path', title: s.path, 'data-testid': 'checkpoint-path' }, s.path),
    el('span', { 'data-testid': 'checkpoint-format' }, el('b', {}, s.format)),
    el('span', {}, el('b', {}, int(s.tensor_count)), ' tensors'),
    el('span', { title: `${int(s.params)} elements` }, el('b', {}, count(s.params)), ' params'),
    el('span', { title: `${int(s.nbytes)} bytes` }, el('b', {}, bytes(s.nbytes))),
    el('span', {}, el('b', {}, int(s.files.length)), ` file${s.files.length === 1 ? '' : 's'}`));
}

export function renderConfig(box, summary) {
  const config = summary.config;
  if (!config) {
    box.hidden = true;
    return;
  }
  const dl = el('dl', {});
  for (const [key, label] of CONFIG_LABELS) {
    let v = config[key];
    if (v === null || v === undefined) continue;
    if (Array.isArray(v)) v = v.join(', ');
    dl.append(el('dt', {}, label), el('dd', { 'data-config': key }, typeof v === 'number' ? int(v) : String(v)));
  }
  const title = [config.architectures && config.architectures[0], config.model_type].filter(Boolean).join(' · ') || 'config.json';
  box.replaceChildren(el('summary', {}, `Model: ${title}`), dl);
  box.hidden = false;
}
