-- claim.lua: claim the jobs of entries the `workers` group delivered, and settle the entries whose
-- jobs will not run (`sluice.wire.streams.StreamConsumer.claim`, arguments by
-- `sluice.wire.script_calls.claim_call`).
--
-- KEYS[1]: the version's webhook outbox
-- KEYS[2]: its dead-letter stream
-- KEYS[3]: its online stream
-- KEYS[4]: its bulk stream
-- KEYS[5..]: per entry, its job's hash
-- Every key is of the version's slot (`sluice.wire.keys`), so the script runs on a Redis Cluster.
--
-- ARGV[1]: now
-- ARGV[2]: the worker (consumer) name
-- ARGV[3]: max_deliveries
-- ARGV[4]: the events channel, the prefix of each job's own channel (lib/job_changed.lua)
-- ARGV[5]: the consumer group
-- ARGV[6]: the dead letters' cap (MAXLEN ~)
-- ARGV[7..]: per entry, three values: its lane (1 online, 2 bulk), entry id, job id
--
-- Returns: per entry, {'run', input, attempts, input_ref or '', output_ref or ''} for a job now
-- running (the references: sluice/references.py); {state} for a job already
-- final; {'missing'} for a vanished one; {'expired'} for one past its deadline; {'dead', last
-- error} for one delivered max_deliveries times.
--
-- Per entry: queued/running -> running, announced, and the input handed back. One past its
-- deadline becomes `expired`, one delivered as often as it may be becomes `failed` and is
-- dead-lettered, both announced. Every entry whose job will not run is acknowledged and deleted in
-- the same step, so claiming a read is one round trip.
--
-- A job may be started max_deliveries times, unless its own retry policy (`sluice.retry`, the
-- record's `retry`: "n:word,word") says otherwise: n starts at least, and exactly n where it lists
-- worker_error. A running job delivered again lost its last run without an outcome: where that run
-- left no error of its own (finish.lua notes a fault's), its worker died, and that is noted.
--!include lib/queue_webhook.lua
--!include lib/job_changed.lua
--!include lib/ack_and_drop.lua
--!include lib/note_attempt.lua
local now, worker, max_deliveries, channel = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local DIED = 'its worker died while running it'
local function starts_allowed(job)
  local retry = redis.call('HGET', job, 'retry')
  if not retry then return max_deliveries end
  local n = tonumber(string.match(retry, '^(%d+):'))
  if string.find(retry, 'worker_error', 1, true) then return n end
  return math.max(max_deliveries, n)
end
local function claim(job)
  local s = redis.call('HGET', job, 'status')
  if not s then return {'missing'} end
  if s ~= 'queued' and s ~= 'running' then return {s} end
  local deadline = tonumber(redis.call('HGET', job, 'deadline') or '')
  if deadline and tonumber(now) > deadline then
    redis.call('HSET', job, 'status', 'expired', 'finished_at', now,
      'error', '{"code":"expired","message":"the job deadline passed before it started"}')
    queue_webhook(job, KEYS[1])
    return {'expired'}
  end
  local attempts = tonumber(redis.call('HGET', job, 'attempts') or '0')
  if s == 'running' and noted_attempts(job) < attempts then
    note_attempt(job, {code = 'worker_error', message = DIED}, now)
  end
  if attempts >= starts_allowed(job) then
    local last = redis.call('HGET', job, 'last_error') or DIED
    redis.call('HSET', job, 'status', 'failed', 'finished_at', now,
      'error', cjson.encode({code='max_deliveries',
        message='delivered ' .. attempts .. ' times without finishing; last error: ' .. last}))
    queue_webhook(job, KEYS[1])
    return {'dead', last}
  end
  redis.call('HSET', job, 'status', 'running', 'worker', worker)
  redis.call('HINCRBY', job, 'attempts', 1)
  local refs = redis.call('HMGET', job, 'input_ref', 'output_ref')
  return {'run', redis.call('HGET', job, 'input'), tostring(attempts + 1), refs[1] or '', refs[2] or ''}
end
local replies, settled = {}, {{}, {}}
for e = 1, #KEYS - 4 do
  local a = 3 * e + 4
  local lane, entry, id = tonumber(ARGV[a]), ARGV[a + 1], ARGV[a + 2]
  local job = KEYS[e + 4]
  local reply = claim(job)
  if reply[1] == 'run' then
    job_changed(channel, job, id, 'running')
  else
    table.insert(settled[lane], entry)
    if reply[1] == 'expired' then
      job_changed(channel, job, id, 'expired')
    elseif reply[1] == 'dead' then
      redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'id', id, 'error', reply[2], 't', now)
      job_changed(channel, job, id, 'failed')
    end
  end
  replies[e] = reply
end
ack_and_drop(settled, ARGV[5])
return replies
