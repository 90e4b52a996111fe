// A virtual scroller: a list of any length where only the rows in view (plus a little overscan)
// exist in the DOM. A 20,000-tensor checkpoint then costs ~50 elements, not 20,000.

export class VirtualList {
  /**
   * @param {HTMLElement} container  scrollable element (overflow: auto), emptied and owned by the list
   * @param {{rowHeight: number, render: (i: number) => HTMLElement, overscan?: number,
   *          afterDraw?: (rows: HTMLElement[]) => void}} options  afterDraw: adjust the rows once laid out
   */
  constructor(container, { rowHeight, render, overscan = 8, afterDraw = null }) {
    this.container = container;
    this.rowHeight = rowHeight;
    this.render = render;
    this.afterDraw = afterDraw;
    this.overscan = overscan;
    this.count = 0;
    this.spacer = document.createElement('div');
    this.spacer.className = 'vlist-spacer';
    this.window = document.createElement('div');
    this.window.className = 'vlist-window';
    this.spacer.append(this.window);
    container.replaceChildren(this.spacer);
    this.pending = false;
    container.addEventListener('scroll', () => this.schedule(), { passive: true });
    new ResizeObserver(() => this.schedule()).observe(container);
  }

  setCount(n) {
    this.count = n;
    this.spacer.style.height = `${n * this.rowHeight}px`;
    this.draw();
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.draw();
    });
  }

  /** Re-render the rows in view (after the data behind them changed). */
  draw() {
    const { scrollTop, clientHeight } = this.container;
    const first = Math.max(0, Math.floor(scrollTop / this.rowHeight) - this.overscan);
    const visible = Math.ceil((clientHeight || 600) / this.rowHeight) + 2 * this.overscan;
    const last = Math.min(this.count, first + visible);
    this.window.style.transform = `translateY(${first * this.rowHeight}px)`;
    const rows = [];
    for (let i = first; i < last; i++) {
      const row = this.render(i);
      row.style.height = `${this.rowHeight}px`;
      rows.push(row);
    }
    this.window.replaceChildren(...rows);
    if (this.afterDraw) this.afterDraw(rows);
  }

  /** Scroll the least needed to show row i. */
  scrollToIndex(i) {
    const top = i * this.rowHeight;
    const { scrollTop, clientHeight } = this.container;
    if (top < scrollTop) this.container.scrollTop = top;
    else if (top + this.rowHeight > scrollTop + clientHeight) this.container.scrollTop = top + this.rowHeight - clientHeight;
    this.draw();
  }
}
