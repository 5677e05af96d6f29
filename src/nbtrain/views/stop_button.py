"""The Dashboard's Stop button: it must reach a run whose cell keeps the kernel busy.

A widget's click is a message on the kernel's shell channel, and a kernel reads that
channel only between cells: a button in Python cannot stop `%%fasttrain` on your own
loop, or a blocking `nt.fit(..., progress=nt.Dashboard)`, while their cell runs. So the
button does in the browser what the notebook's interrupt button (■) does: it asks the
Jupyter server to interrupt the kernel (POST /api/kernels/<id>/interrupt, the REST call
JupyterLab and Notebook 7 make), and the run ends at the next step boundary as after a
Ctrl-C (state "interrupted", nothing lost). A run training in a thread of its own
(`fit(background=True)`) gets the click as a message instead, and calls `run.stop()`.
"""
from __future__ import annotations

import re
import threading
from typing import Callable, Iterable

import anywidget
import traitlets

_ESM = r"""
function pageConfig() {
  const el = document.getElementById("jupyter-config-data");
  try { return el ? JSON.parse(el.textContent) : {}; } catch (e) { return {}; }
}

function cookie(name) {
  const m = document.cookie.match("\\b" + name + "=([^;]*)\\b");
  return m ? decodeURIComponent(m[1]) : undefined;
}

// What JupyterLab's own interrupt does: the kernel's REST endpoint, with the page's
// token and the server's XSRF cookie.
async function interruptKernel(kernelId) {
  const config = pageConfig();
  if (!kernelId || config.baseUrl === undefined) {
    return [false, "no Jupyter server page here: use your front end's interrupt (■) instead"];
  }
  const headers = {};
  if (config.token) headers["Authorization"] = "token " + config.token;
  const xsrf = cookie("_xsrf");
  if (xsrf) headers["X-XSRFToken"] = xsrf;
  const base = config.baseUrl.endsWith("/") ? config.baseUrl : config.baseUrl + "/";
  try {
    const reply = await fetch(base + "api/kernels/" + kernelId + "/interrupt",
                              { method: "POST", headers, credentials: "same-origin" });
    if (reply.ok) return [true, "interrupted the kernel: the loop ends at the next step"];
    return [false, "the server refused the interrupt (" + reply.status + "): use ■ instead"];
  } catch (e) {
    return [false, "could not reach the server (" + e + "): use ■ instead"];
  }
}

export default {
  render({ model, el }) {
    const button = document.createElement("button");
    button.className = "jupyter-widgets jupyter-button widget-button mod-danger";
    button.textContent = "■ Stop";
    button.title = "end the run at the next step boundary; nothing trained is lost";
    const note = document.createElement("span");
    note.className = "nbtrain-stop-note";
    note.style.marginLeft = "0.8em";
    const show = () => {
      button.disabled = !model.get("running");
      if (!model.get("running")) note.textContent = "";   // the run ended: the note is done
    };
    button.addEventListener("click", async () => {
      button.disabled = true;
      if (model.get("interrupts")) {
        // no message: a busy kernel would read it only after the cell, and could then
        // stop a run that a later cell started
        const [sent, text] = await interruptKernel(model.get("kernel_id"));
        note.textContent = text;
        if (!sent) button.disabled = !model.get("running");   // another try stays possible
      } else {
        model.send({ event: "stop" });
        note.textContent = "stopping at the next step...";
      }
    });
    model.on("change:running", show);
    show();
    el.classList.add("nbtrain-stop");
    el.append(button, note);
    return () => model.off("change:running", show);
  },
};
"""


def kernel_id() -> str:
    """This kernel's id as the Jupyter server knows it ('' outside one): the server names
    a kernel's connection file kernel-<id>.json (jupyter_client's KernelManager)."""
    try:
        from ipykernel.connect import get_connection_file
        found = re.search(r"kernel-([^/\\]+)\.json$", get_connection_file())
    except Exception:
        return ""
    return found.group(1) if found else ""


class StopButton(anywidget.AnyWidget):
    """A Stop for the runs a Dashboard shows; `update(runs)` after each draw."""

    _esm = _ESM
    running = traitlets.Bool(False).tag(sync=True)      # a run it can stop is running
    interrupts = traitlets.Bool(False).tag(sync=True)   # that run keeps the kernel busy
    kernel_id = traitlets.Unicode("").tag(sync=True)

    def __init__(self, stop: Callable[[], None], **kwargs):
        super().__init__(kernel_id=kernel_id(), **kwargs)
        self._stop = stop
        self.on_msg(self._on_click)

    def ended(self) -> None:
        """A run ended: disabled now, from the training thread, before its Ctrl-C handler
        goes (a click after that would interrupt whatever the kernel runs next)."""
        self.running = False

    def update(self, runs: Iterable) -> None:
        running = [run for run in runs if run.running]
        blocking = any(_blocks_the_kernel(run) for run in running)
        if (bool(running), blocking) != (self.running, self.interrupts):   # no message otherwise
            self.interrupts, self.running = blocking, bool(running)

    def _on_click(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("event") == "stop":
            self._stop()


def _blocks_the_kernel(run) -> bool:
    """The run trains in the kernel's main thread (a blocking fit, nt.watch): the kernel
    reads no message until it ends."""
    return run.training_thread is threading.main_thread()
