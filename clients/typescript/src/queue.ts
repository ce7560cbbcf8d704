/** An unbounded FIFO whose `shift` waits with a timeout and an optional AbortSignal. */

export class Queue<T> {
  private items: T[] = [];
  private waiters: Array<(item: T) => void> = [];

  push(item: T): void {
    const waiter = this.waiters.shift();
    if (waiter) waiter(item);
    else this.items.push(item);
  }

  /** The next item; rejects with `onTimeout()` after `timeoutMs`, or with the signal's reason. */
  shift(timeoutMs: number, onTimeout: () => Error, signal?: AbortSignal): Promise<T> {
    if (this.items.length) return Promise.resolve(this.items.shift() as T);
    if (signal?.aborted) return Promise.reject(signal.reason);
    return new Promise<T>((resolve, reject) => {
      const settle = () => {
        clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
        const at = this.waiters.indexOf(waiter);
        if (at >= 0) this.waiters.splice(at, 1);
      };
      const waiter = (item: T) => { settle(); resolve(item); };
      const onAbort = () => { settle(); reject(signal?.reason); };
      const timer = setTimeout(() => { settle(); reject(onTimeout()); }, timeoutMs);
      signal?.addEventListener("abort", onAbort, { once: true });
      this.waiters.push(waiter);
    });
  }
}
