/**
 * JupyterLab plugin: the "Elastic training" left side panel, its commands and its settings.
 */
import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Dialog, ICommandPalette, InputDialog, showDialog } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { LabIcon } from '@jupyterlab/ui-components';

import { Requester, RunsClient } from './common/api';
import { isActive } from './common/snapshot';
import { ElasticPanel } from './panel/panel';

const PLUGIN_ID = 'elastic-jupyter:plugin';
const CATEGORY = 'Elastic training';

const elasticIcon = new LabIcon({
  name: 'elastic-jupyter:icon',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
    '<rect x="2" y="14" width="4" height="8" rx="1"/><rect x="8" y="9" width="4" height="13" rx="1"/>' +
    '<rect x="14" y="4" width="4" height="18" rx="1"/><path d="M19 2l3 3-3 3V6h-2V4h2z"/></g></svg>'
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'Side panel listing elastic training runs, with resize, stop, loss chart and checkpoints.',
  autoStart: true,
  optional: [ICommandPalette, ISettingRegistry, ILayoutRestorer],
  activate: (
    app: JupyterFrontEnd,
    palette: ICommandPalette | null,
    settings: ISettingRegistry | null,
    restorer: ILayoutRestorer | null
  ) => {
    const api = new RunsClient(serverRequester());
    const panel = new ElasticPanel(api, {
      openPath: async path => {
        // the folder first: an old checkpoint may have been pruned (--keep) meanwhile
        const folder = path.split('/').slice(0, -1).join('/');
        await app.commands.execute('filebrowser:activate', { path: folder });
        await app.commands.execute('filebrowser:go-to-path', { path: folder });
        await app.commands.execute('filebrowser:go-to-path', { path }).catch(() => undefined);
      },
      confirm: async (title, body) =>
        (await showDialog({ title, body, buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop' })] })).button.accept
    });
    panel.id = 'elastic-jupyter-panel';
    panel.title.icon = elasticIcon;
    panel.title.caption = 'Elastic training';
    app.shell.add(panel, 'left', { rank: 650 });
    restorer?.add(panel, panel.id);

    const chooseRun = async (title: string) => {
      const runs = (await api.runs().catch(() => panel.knownRuns)).filter(isActive);
      if (!runs.length) {
        await showDialog({ title, body: 'No run is training.', buttons: [Dialog.okButton()] });
        return null;
      }
      const labels = runs.map(r => `${r.name} (${r.notebook ?? r.id})`);
      const choice = await InputDialog.getItem({ title, items: labels });
      return choice.button.accept && choice.value ? runs[labels.indexOf(choice.value)] : null;
    };
    app.commands.addCommand('elastic:open-panel', {
      label: 'Elastic: open training panel',
      execute: () => app.shell.activateById(panel.id)
    });
    app.commands.addCommand('elastic:resize-run', {
      label: 'Elastic: resize run',
      execute: async () => {
        const run = await chooseRun('Resize which run?');
        if (!run) {
          return;
        }
        const size = await InputDialog.getNumber({
          title: `World size for '${run.name}' (${run.min_size ?? 1}-${run.max_size ?? '?'})`,
          value: run.requested_size || run.world_size
        });
        if (size.button.accept && size.value !== null) {
          await panel.resize(run.id!, size.value);
        }
      }
    });
    app.commands.addCommand('elastic:stop-run', {
      label: 'Elastic: stop run',
      execute: async () => {
        const run = await chooseRun('Stop which run?');
        if (run) {
          await panel.stop(run.id!);
        }
      }
    });
    for (const command of ['elastic:open-panel', 'elastic:resize-run', 'elastic:stop-run']) {
      palette?.addItem({ command, category: CATEGORY });
    }

    settings?.load(PLUGIN_ID).then(s => {
      const apply = () => (panel.pollInterval = s.get('pollInterval').composite as number);
      apply();
      s.changed.connect(apply);
    }).catch(reason => console.error('elastic-jupyter: cannot load settings', reason));
  }
};

/** Requests through JupyterLab's ServerConnection: base URL, token and XSRF header. */
function serverRequester(): Requester {
  const settings = ServerConnection.makeSettings();
  return (path, init) => ServerConnection.makeRequest(URLExt.join(settings.baseUrl, path), init, settings);
}

export default plugin;
