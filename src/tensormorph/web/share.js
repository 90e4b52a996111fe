// Copying a view out of the page: the text goes to the clipboard, and a toast shows what was copied. Where
// the browser refuses the clipboard (a page served over plain HTTP to another machine is no secure
// context), the toast holds the text selected, ready for Ctrl+C.

import { el } from './format.js';

const TOAST_MS = 4000;  // how long a "copied" toast stays

let hideTimer = 0;

/** Copy `text`; `what` names it in the toast ("link", "command"). The toast keeps it in data-copied. */
export async function copyText(toast, text, what) {
  clearTimeout(hideTimer);
  toast.dataset.copied = text;
  toast.hidden = false;
  try {
    await navigator.clipboard.writeText(text);
    toast.classList.remove('manual');
    toast.replaceChildren(el('b', {}, `Copied the ${what}`), el('code', {}, text));
    hideTimer = setTimeout(() => { toast.hidden = true; }, TOAST_MS);
  } catch {
    const field = el('input', { type: 'text', readonly: true, value: text, 'aria-label': `The ${what}` });
    toast.classList.add('manual');
    toast.replaceChildren(el('b', {}, `Copy the ${what} (Ctrl+C):`), field,
      el('button', { type: 'button', class: 'linkish', onclick: () => { toast.hidden = true; } }, 'close'));
    field.focus();
    field.select();
  }
}
