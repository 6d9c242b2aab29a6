-- settle.lua: make jobs final that no worker will run (`sluice.wire.settling`): queued jobs past
-- their deadline (`expired`, the scheduler's sweeper), or every unfinished job of a retired
-- version once its drain limit has passed (`failed`, code `version_retired`).
--
-- KEYS[1]: the version's webhook outbox
-- KEYS[2..]: the jobs' hashes
-- Every key is of the version's slot (`sluice.wire.keys`), so the script runs on a Redis Cluster.
--
-- ARGV[1]: now
-- ARGV[2]: the events channel, the prefix of each job's own channel (lib/job_changed.lua)
-- ARGV[3]: the final status to write
-- ARGV[4]: the error to record (JSON)
-- ARGV[5]: '1' to settle running jobs too, '0' for queued ones only
-- ARGV[6]: '1' to settle only jobs whose deadline is past `now`
--
-- Returns: per job, {tenant, job id} where it was settled here, else false.
--
-- A job already final (or settled by a worker meanwhile) is left as it is: a final state is
-- written once. Each settled job gets its webhook queued and its change announced in the same
-- step, as every script that makes a job final does; its quota place is freed by the caller (the
-- tenant's slot is another).
--!include lib/queue_webhook.lua
--!include lib/job_changed.lua
local now, channel, status, err = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local running_too, past_deadline = ARGV[5] == '1', ARGV[6] == '1'
local settled = {}
for k = 2, #KEYS do
  local job = KEYS[k]
  local s = redis.call('HGET', job, 'status')
  local due = s == 'queued' or (running_too and s == 'running')
  if due and past_deadline then
    local deadline = tonumber(redis.call('HGET', job, 'deadline') or '')
    due = deadline ~= nil and tonumber(now) > deadline
  end
  if due then
    redis.call('HSET', job, 'status', status, 'finished_at', now, 'error', err)
    queue_webhook(job, KEYS[1])
    local id = redis.call('HGET', job, 'id')
    job_changed(channel, job, id, status)
    settled[#settled + 1] = {redis.call('HGET', job, 'tenant'), id}
  else
    settled[#settled + 1] = false
  end
end
return settled
