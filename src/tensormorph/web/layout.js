// Pane layout: the tensor list (left) and the inspector (right) collapse, by the toolbar's buttons or the
// [ and ] keys, so that the heatmap gets the room. Below NARROW_PX the inspector starts hidden and, when
// shown, lies over the heatmap instead of pushing the page past the window's edge.

const NARROW_PX = 900;

export class Panes {
  constructor({ toggleLeft, toggleRight }) {
    this.narrow = window.matchMedia(`(max-width: ${NARROW_PX}px)`);
    this.narrow.addEventListener('change', () => this.set('right', this.narrow.matches));
    this.set('right', this.narrow.matches);
    toggleLeft.addEventListener('click', () => this.toggle('left'));
    toggleRight.addEventListener('click', () => this.toggle('right'));
    this.buttons = { left: toggleLeft, right: toggleRight };
    this.sync();
  }

  hidden(side) {
    return document.body.classList.contains(`hide-${side}`);
  }

  set(side, hidden) {
    document.body.classList.toggle(`hide-${side}`, hidden);
    this.sync();
  }

  toggle(side) {
    this.set(side, !this.hidden(side));
  }

  sync() {
    if (!this.buttons) return;
    for (const side of ['left', 'right']) {
      this.buttons[side].classList.toggle('on', !this.hidden(side));
      this.buttons[side].setAttribute('aria-pressed', String(!this.hidden(side)));
    }
  }
}
