/** Default endpoint, as kvmux/paths.py computes it (override with KVMUX_ENDPOINT). */

import { userInfo } from "node:os";
import { join } from "node:path";

export function runtimeDir(): string {
  const base = process.env.KVMUX_RUNTIME_DIR;
  if (base) return base;
  const xdg = process.env.XDG_RUNTIME_DIR;
  return xdg ? join(xdg, "kvmux") : `/tmp/kvmux-${userInfo().uid}`;
}

export function defaultFrontend(): string {
  return process.env.KVMUX_ENDPOINT || `ipc://${join(runtimeDir(), "frontend.ipc")}`;
}
