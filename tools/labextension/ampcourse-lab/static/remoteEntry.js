// ampcourse-lab: the course's front-end rules for JupyterLab 4, as a prebuilt ("federated") extension written
// by hand: no build step, no npm. tools/lab_config.py puts this folder on LabApp.extra_labextensions_path and
// tells it the read-only folders and the workspace (page config "ampcourse"). It needs no JupyterLab module:
// it works on the document widgets the shell holds (their `context`), so it is one plain file.
//
// Rules (tests/course/test_browser.py checks both in Chromium):
// 1. A full chapter (chapters/, read-only) and the learner's copy (workspace/) have the same file name; the
//    full chapter's tab reads "[full] NAME" in italics (a class on the tab and a CSS ::before: changing the
//    tab's label itself would make JupyterLab rename the file), so two tabs never look alike.
// 2. Save As from a full chapter (File > Save As, or "Save as" when closing an edited one) proposes
//    WORKSPACE/edited_NAME instead of the read-only chapters/NAME, which the server refuses: that proposal
//    made closing an edited chapter loop (Save as -> refused -> Save as ...).
var _JUPYTERLAB;
(function () {
  "use strict";
  var NAME = "ampcourse-lab";
  var CLASS = "ampcourse-full-chapter";  // on a full chapter's tab: the stylesheet below adds the mark
  var DEFAULTS = { readOnly: ["chapters"], workspace: "workspace", mark: "[full] ", prefix: "edited_" };

  function settings() {
    try {
      var data = JSON.parse(document.getElementById("jupyter-config-data").textContent);
      return Object.assign({}, DEFAULTS, data.ampcourse || {});
    } catch (err) {
      return DEFAULTS;
    }
  }

  function readOnly(path, conf) {
    var first = String(path || "").replace(/^\/+/, "").split("/")[0];
    return path.indexOf("/") > 0 && conf.readOnly.indexOf(first) >= 0;
  }

  function proposal(path, conf) {
    var name = String(path).split("/").pop();
    return (conf.workspace ? conf.workspace.replace(/\/+$/, "") + "/" : "") + conf.prefix + name;
  }

  function mark(widget, conf) {
    var context = widget && widget.context;
    if (!context || typeof context.saveAs !== "function" || !readOnly(context.path, conf)) {
      return;
    }
    // A class, not a new label: JupyterLab renames the file when a document's tab label changes.
    if (widget.title.className.split(/\s+/).indexOf(CLASS) < 0) {
      widget.title.className += " " + CLASS;
    }
    if (context.__ampcourseSaveAs) {
      return;
    }
    var saveAs = Object.getPrototypeOf(context).saveAs;
    context.__ampcourseSaveAs = true;
    // JupyterLab's saveAs proposes `this.path` in its dialog and saves to what the learner confirms; for the
    // length of the call the proposal is the workspace file (the context's real path, _path, is untouched).
    context.saveAs = function () {
      var self = this;
      var target = proposal(self.path, conf);
      Object.defineProperty(self, "path", { configurable: true, get: function () { return target; } });
      var restore = function () { delete self.path; };
      return Promise.resolve(saveAs.call(self)).then(
        function (result) { restore(); return result; },
        function (err) { restore(); throw err; });
    };
  }

  function addStyle(conf) {
    if (document.getElementById(NAME + "-style")) {
      return;
    }
    var style = document.createElement("style");
    style.id = NAME + "-style";
    // before the name, so a tab too narrow for the whole name still shows it; italic, so it stands out
    style.textContent = ".lm-TabBar-tab." + CLASS + " .lm-TabBar-tabLabel::before { content: " +
      JSON.stringify(conf.mark) + "; font-weight: 600; } .lm-TabBar-tab." + CLASS + " { font-style: italic; }";
    document.head.appendChild(style);
  }

  function scan(app, conf) {
    var widgets = app.shell.widgets ? app.shell.widgets("main") : [];
    for (var widget of widgets) {
      mark(widget, conf);
    }
  }

  var plugin = {
    id: NAME + ":plugin",
    description: "A full chapter's tab says so; Save As from it proposes the learner's workspace.",
    autoStart: true,
    activate: function (app) {
      var conf = settings();
      addStyle(conf);
      var again = function () { scan(app, conf); };
      if (app.shell.layoutModified) { app.shell.layoutModified.connect(again); }
      if (app.shell.currentChanged) { app.shell.currentChanged.connect(again); }
      app.restored.then(again);
      window.__ampcourseLab = { proposal: function (p) { return proposal(p, conf); }, settings: conf };
    }
  };

  var container = {
    init: function () { return Promise.resolve(); },  // shares no modules, needs none
    get: function (module) {
      if (module === "./extension" || module === "./index") {
        return Promise.resolve(function () { return { __esModule: true, default: [plugin] }; });
      }
      return Promise.reject(new Error('Module "' + module + '" does not exist in container ' + NAME));
    }
  };
  _JUPYTERLAB = _JUPYTERLAB || {};
  _JUPYTERLAB[NAME] = container;
})();
