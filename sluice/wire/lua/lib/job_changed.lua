-- job_changed(channel, job, id, status): announce a job's new status on the job's own channel.
--
-- KEYS: none (SPUBLISH names a channel, not a key).
-- ARGV: none of its own; `channel` is the calling script's events channel argument and `job` the
-- job's hash key: together they name the job's sharded channel
-- (`sluice.wire.keys.job_events_channel`), which is of the job's slot, as a script on a cluster
-- requires.
--
-- The Lua twin of `sluice.wire.events.encode` for a JobChanged: the scripts that change a job's
-- state announce it in the same atomic step as the state they write.
local function job_changed(channel, job, id, status)
  redis.call('SPUBLISH', channel .. ':' .. job, cjson.encode({type='job', id=id, status=status}))
end
